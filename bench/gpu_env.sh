# Sourced by the one-call GPU scripts (bench/gpu_session*.sh): installs the carried wheels (.whl/,
# docs/gpu.md) into /tmp/site, writes the machine's versions to $OUT/env.txt and checks that the
# engine and our own imports load (exit 3: the wheels, 4: the imports). First, what every such script
# starts with: set -u, unbuffered Python, $OUT (the device tool's folder, or ./gpu-out), and
# left(): the seconds of BUDGET (set before sourcing) that remain, counted from here.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys,torch,transformers,diffusers,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'cudnn',torch.backends.cudnn.version(),'transformers',transformers.__version__,'diffusers',diffusers.__version__,'triton',triton.__version__)"
  python3 -c "import flash_attn" 2>&1 | tail -1; df -h /tmp | tail -1; nproc; free -g | sed -n 2p; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "import sys; sys.path.insert(0,'.'); from wan_s2v_runner.loading.engine import import_wan; import_wan(); import rich, pydantic; print('engine imports')" || exit 4
