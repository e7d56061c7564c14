#!/bin/bash
# One device call (docs/gpu.md, "The warm agent and the DiT read while encoding, on a GPU"):
# 1. `wan-s2v warm` on CUDA (bench/gpu_forked.py): three rounds of a run spawned and a run forked
#    from the warm agent (tiny preset, --device cuda, preflight on): the same frames, the ranks still
#    forked from their agent (nothing imported initialised CUDA), and the time to the first step;
#    meanwhile the ~46 GB random real-size checkpoint is written in the background;
# 2. the DiT read while the encoders run, on the GPU (docs/gpu.md "Next" 6): `wan-s2v run` at
#    1024x704, one clip of one step, --no-offload-model, loaded first (today's rule on a GPU) and then
#    overlapped (bench/overlap_probe: the CPU's rule), each with its time to the first step and its
#    GPU peak per stage (bench/gpu_pipeline.py).
# Carries .whl (the wheels of bench/gpu_env.sh, setproctitle among them; .whl/extra: imageio_ffmpeg
# without its binary and an xz'd ffmpeg, so `save` writes the mp4 and preflight passes).
BUDGET=${BUDGET:-460}; CKPT=${CKPT:-/tmp/s2v-random}
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
cp -r .whl/extra/imageio_ffmpeg /tmp/site/ \
  && python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.whl/extra/ffmpeg.xz'), open('/tmp/ffmpeg', 'wb'))" \
  && chmod +x /tmp/ffmpeg || exit 3
export IMAGEIO_FFMPEG_EXE=/tmp/ffmpeg
( python3 -m wan_s2v_runner.demo.real_checkpoint "$CKPT" --device cuda > "$OUT/checkpoint.txt" 2>&1; echo "rc=$?" >> "$OUT/checkpoint.txt" ) &
CK=$!
echo "== 1. wan-s2v warm on CUDA: spawned against forked ($(left) s left)"
timeout -k 5 150 python3 bench/gpu_forked.py --preset tiny --rounds 3 --json "$OUT/forked.json" > "$OUT/forked.txt" 2>&1
echo "rc=$?"; grep -v -i "warn" "$OUT/forked.txt" | tail -40
echo "== waiting for the checkpoint ($(left) s left)"
timeout $(( $(left) - 255 )) tail --pid=$CK -f /dev/null; tail -4 "$OUT/checkpoint.txt"
for side in first overlap; do
  echo "== 2. 1024x704, one step: the DiT loaded $side ($(left) s left)"
  probe=""; [ $side = overlap ] && probe=--overlap-probe
  timeout -k 5 125 python3 bench/gpu_pipeline.py --ckpt "$CKPT" --out /tmp/gp-$side --num-clips 1 --steps 1 \
    $probe --json "$OUT/pipeline-$side.json" -- --no-offload-model > "$OUT/pipeline-$side.txt" 2>&1
  echo "rc=$?"; grep -v -i "warn" "$OUT/pipeline-$side.txt" | tail -34
  cp /tmp/gp-$side/runs/*/run.json "$OUT/run-$side.json" 2>/dev/null
done
pkill -f wan_s2v_runner; echo "total $(( $(date +%s) - T0 )) s"
