#!/bin/bash
# One device call for what #49's first call left (docs/gpu.md, "Real size on one GPU"): the runner's
# --compile (patches/compile_blocks.py) on the real-size DiT step against eager, while the ~46 GB
# random checkpoint is written in the background; then `wan-s2v run` at 1024x704 on that checkpoint
# (one clip, two steps; --skip-preflight: the image lacks imageio-ffmpeg, so it stops in save) with
# the doctor's memory plan against it. Each part is bounded so the call
# ends inside BUDGET seconds (default 530). Wheels in .whl/ as for bench/gpu_session.sh.
BUDGET=${BUDGET:-530}; CKPT=${CKPT:-/tmp/s2v-random}
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
# the checkpoint, in the background (disk and host bound; its tensors are made on the GPU in bursts)
( python3 -m wan_s2v_runner.demo.real_checkpoint "$CKPT" --device cuda > "$OUT/checkpoint.txt" 2>&1; echo "rc=$?" >> "$OUT/checkpoint.txt" ) &
CK=$!
echo "== step, eager then --compile ($(left) s left)"
TORCH_LOGS=recompiles,graph_breaks timeout -k 5 ${STEP_S:-290} \
  python3 bench/gpu_step.py --compile blocks --warmup 1 --repeat 1 --json "$OUT/step-compiled.json" > "$OUT/step-compiled.txt" 2>&1
echo "rc=$?"; grep -v -i "warning\|autocast\|warn(" "$OUT/step-compiled.txt" | tail -25
echo "== waiting for the checkpoint ($(left) s left)"
timeout $(( $(left) - 150 )) tail --pid=$CK -f /dev/null; tail -12 "$OUT/checkpoint.txt"
echo "== pipeline: one clip, two steps ($(left) s left)"
timeout -k 5 $(( $(left) - 8 )) python3 bench/gpu_pipeline.py --ckpt "$CKPT" --out /tmp/gp --num-clips 1 --steps 2 --skip-preflight \
  --json "$OUT/pipeline.json" > "$OUT/pipeline.txt" 2>&1
echo "rc=$?"; tail -40 "$OUT/pipeline.txt"
cp /tmp/gp/run.log "$OUT/run.log" 2>/dev/null; cp /tmp/gp/runs/*/run.json "$OUT/" 2>/dev/null
pkill -f wan_s2v_runner; echo "total $(( $(date +%s) - T0 )) s"
