#!/bin/bash
# One device call for the real-size DiT step (docs/gpu.md, "Real size on one GPU"): the machine's
# versions, the eager step with its operation count, the step with each DiT block compiled, and the
# first clip's step, each bounded so the whole call ends inside BUDGET seconds (default 560).
# The engine and what it imports that the GPU image lacks travel as wheels in .whl/ (docs/gpu.md says
# which); results land in $OUT (the device tool's folder) or ./gpu-out.
BUDGET=${BUDGET:-560}
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
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
