#!/bin/bash
# Issue #57's whole streamed run (docs/gpu.md, "The DiT streamed block by block"): the ~46 GB random
# real-size checkpoint, then `wan-s2v run --dit-offload blocks --dit-quant fp8` at 1024x704 (one
# clip, one step; every block streamed: --skip-preflight leaves --resident-blocks at 0; the image
# lacks imageio-ffmpeg, so it stops in save) with the doctor's plan against its per-stage GPU peaks.
# Bounded by BUDGET seconds (default 275). Wheels in .whl/ as for bench/gpu_session.sh.
BUDGET=${BUDGET:-275}; CKPT=${CKPT:-/tmp/s2v-random}
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
echo "== the checkpoint ($(left) s left)"
timeout $(( $(left) - 120 )) python3 -m wan_s2v_runner.demo.real_checkpoint "$CKPT" --device cuda > "$OUT/checkpoint.txt" 2>&1
echo "rc=$?"; tail -2 "$OUT/checkpoint.txt"
echo "== pipeline: streamed, fp8, one clip, one step ($(left) s left)"
timeout -k 5 $(( $(left) - 6 )) python3 bench/gpu_pipeline.py --ckpt "$CKPT" --out /tmp/gp --num-clips 1 --steps 1 \
  --skip-preflight --json "$OUT/pipeline-stream.json" -- --dit-offload blocks --dit-quant fp8 > "$OUT/pipeline-stream.txt" 2>&1
echo "rc=$?"; grep -v -i "warning\|autocast\|warn(" "$OUT/pipeline-stream.txt" | tail -40
cp /tmp/gp/run.log "$OUT/run-stream.log" 2>/dev/null; cp /tmp/gp/runs/*/run.json "$OUT/run-stream.json" 2>/dev/null
pkill -f wan_s2v_runner; echo "total $(( $(date +%s) - T0 )) s"
