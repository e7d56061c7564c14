#!/bin/bash
# Issue #47's GPU rows (docs/gpu.md, "FP8 at real size"), as bounded device calls:
# 1. the real-size DiT step in bf16, then quantized in place by --dit-quant fp8's rule and timed
#    both ways an fp8 Linear multiplies (--fp8-matmul dequant, scaled-mm), one Linear of each shape
#    timed the three ways, and the scaled-mm DiT compiled per block (~300 s on an H100);
# 2. the ~46 GB random checkpoint (~100 s; in the background of 1 on a card of 120 GiB or more,
#    after it on an 80 GB card, where the two do not fit side by side);
# 3. `wan-s2v run --dit-quant fp8 --fp8-matmul scaled-mm` at 1024x704 on it (one clip, two steps,
#    ~140 s; --skip-preflight: the image lacks imageio-ffmpeg, so it stops in save) with the
#    doctor's memory plan against it.
# Each part is bounded so the call ends inside BUDGET seconds (default 540). On an 80 GB card run
# it twice: SKIP_RUN=1, then SKIP_STEP=1. Wheels in .whl/ as for bench/gpu_session.sh.
BUDGET=${BUDGET:-540}; CKPT=${CKPT:-/tmp/s2v-random}
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
write_ckpt() { python3 -m wan_s2v_runner.demo.real_checkpoint "$CKPT" --device cuda > "$OUT/checkpoint.txt" 2>&1; echo "rc=$?" >> "$OUT/checkpoint.txt"; }
# the writer holds ~32 GiB of the GPU while the bf16 step needs 48: side by side only on a card of
# 120 GiB or more (an H200); on an 80 GB H100 the first try ran out of memory, so it waits there
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ -z "${SKIP_RUN:-}" ] && [ "${GPU_MIB:-0}" -ge 122880 ]; then write_ckpt & CK=$!; else CK=; fi
if [ -z "${SKIP_STEP:-}" ]; then
echo "== step: bf16, fp8 dequant, fp8 scaled-mm, compiled scaled-mm ($(left) s left)"
TORCH_LOGS=recompiles timeout -k 5 ${STEP_S:-300} \
  python3 bench/gpu_step.py --dit-quant fp8 --fp8-matmul dequant,scaled-mm --linear-times --compile blocks \
  --warmup 1 --repeat 1 --json "$OUT/step-fp8.json" > "$OUT/step-fp8.txt" 2>&1
echo "rc=$?"; grep -v -i "warning\|autocast\|warn(" "$OUT/step-fp8.txt" | tail -25
fi
[ -n "${SKIP_RUN:-}" ] && { echo "total $(( $(date +%s) - T0 )) s"; exit 0; }
echo "== the checkpoint ($(left) s left)"
if [ -n "$CK" ]; then timeout $(( $(left) - 150 )) tail --pid=$CK -f /dev/null; else timeout $(( $(left) - 150 )) bash -c "$(declare -f write_ckpt); CKPT='$CKPT' OUT='$OUT' write_ckpt"; fi
tail -3 "$OUT/checkpoint.txt"
echo "== pipeline: fp8 scaled-mm, one clip, two steps ($(left) s left)"
timeout -k 5 $(( $(left) - 8 )) python3 bench/gpu_pipeline.py --ckpt "$CKPT" --out /tmp/gp --num-clips 1 --steps 2 \
  --skip-preflight --json "$OUT/pipeline-fp8.json" -- --dit-quant fp8 --fp8-matmul scaled-mm > "$OUT/pipeline-fp8.txt" 2>&1
echo "rc=$?"; tail -40 "$OUT/pipeline-fp8.txt"
cp /tmp/gp/run.log "$OUT/run-fp8.log" 2>/dev/null; cp /tmp/gp/runs/*/run.json "$OUT/run-fp8.json" 2>/dev/null
pkill -f wan_s2v_runner; echo "total $(( $(date +%s) - T0 )) s"
