#!/bin/bash
# One device call for the real-size DiT step (docs/gpu.md, "Real size on one GPU"): the machine's
# versions, the eager step with its operation count, the step with each DiT block compiled, and the
# first clip's step, each bounded so the whole call ends inside BUDGET seconds (default 560).
# The engine and what it imports that the GPU image lacks travel as wheels in .whl/ (docs/gpu.md says
# which); results land in $OUT (the device tool's folder) or ./gpu-out.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-560}
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys,torch,transformers,diffusers,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'cudnn',torch.backends.cudnn.version(),'transformers',transformers.__version__,'diffusers',diffusers.__version__,'triton',triton.__version__)"
  python3 -c "import flash_attn" 2>&1 | tail -1; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "import sys; sys.path.insert(0,'.'); from wan_s2v_runner.loading.engine import import_wan; import_wan(); print('engine imports')" || exit 4
step() {  # name, seconds to leave for what follows, gpu_step flags...
  local name=$1 keep=$2; shift 2
  echo "== $name ($(left) s left)"
  timeout $(( $(left) - keep )) python3 bench/gpu_step.py "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "rc=$?"; grep -v -i "warning\|autocast" "$OUT/$name.txt" | tail -12
}
step step 330 --count-flops --repeat 2
step step-compiled 70 --compile blocks --repeat 1
step step-first 5 --first-clip --repeat 1
echo "total $(( $(date +%s) - T0 )) s"
