#!/bin/bash
# One device call for the streamed DiT (issue #57; docs/gpu.md, "The DiT streamed"): the machine's
# versions, then bench/gpu_stream.py's cases in order of need (fp8 at 1024x704 under a 24 GB card's
# cap: the target; fp8 at 832x480 under a 16 GB card's; bf16 at 1024x704 under 24 GB), each case's
# JSON written as it ends, the whole bounded by BUDGET seconds (default 520). Wheels in .whl/ as for
# bench/gpu_session.sh.
BUDGET=${BUDGET:-520}
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # what the runner sets when it streams
echo "== stream ($(left) s left)"
timeout $(( $(left) - 10 )) python3 bench/gpu_stream.py --resident-too \
    --cases "fp8:1024*704:23,fp8:832*480:15,bf16:1024*704:23" --json "$OUT/stream.json" > "$OUT/stream.txt" 2>&1
echo "rc=$?"; grep -v -i "warning\|autocast" "$OUT/stream.txt" | tail -30
echo "total $(( $(date +%s) - T0 )) s"
