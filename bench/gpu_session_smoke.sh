#!/bin/bash
# One device call (docs/gpu.md, "Every job source on CUDA"): the three ways a rank group takes its
# jobs (issue #59's job sources: a run's own job, a batch's list, a server's inbox) run on CUDA with
# the tiny checkpoint, each checked for its exit and its output; the run's mp4 and the batch's job of
# the same spec compared by sha256 (same spec, same seed: the same loop on the same GPU):
# 1. `wan-s2v run --device cuda` (agent spawned);
# 2. `wan-s2v batch --device cuda` of two jobs, the first the run's spec;
# 3. `wan-s2v serve --device cuda` with two jobs submitted over HTTP (bench/gpu_serve.py: its own
#    synthetic inputs, so its videos are not compared);
# 4. `wan-s2v warm` on CUDA: one round of a run forked from the warm agent against one spawned
#    (bench/gpu_forked.py: the same frames, the ranks forked without CUDA initialised in the agent).
# Carries .dev/smoke: the wheels of bench/gpu_env.sh (.whl) and the server's (.dev/a of
# bench/gpu_session_warm.sh: fastapi, starlette, uvicorn, python-multipart), with .whl/extra
# (imageio_ffmpeg without its binary and an xz'd ffmpeg, so `save` writes the mp4 and preflight
# passes); it is taken for .whl here.
BUDGET=${BUDGET:-300}
[ -e .whl ] || ln -s .dev/smoke .whl
source bench/gpu_env.sh  # set -u, $OUT, T0 and left()
cp -r .whl/extra/imageio_ffmpeg /tmp/site/ \
  && python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.whl/extra/ffmpeg.xz'), open('/tmp/ffmpeg', 'wb'))" \
  && chmod +x /tmp/ffmpeg || exit 3
export IMAGEIO_FFMPEG_EXE=/tmp/ffmpeg
W=/tmp/smoke; mkdir -p $W
python3 -c "from pathlib import Path; from wan_s2v_runner.demo.assets import ensure_demo_assets as e; print(e(Path('$W/demo')))" || exit 5
A="--ckpt-dir $W/demo/tiny-s2v-ckpt --image $W/demo/reference.png --audio $W/demo/speech.wav"
S="--device cuda --nproc 1 --size 64*64 --infer-frames 8 --steps 2 --seed 42"
step() { echo "== $1 ($(left) s left)"; }

step "1. run"
timeout -k 5 90 python3 -m wan_s2v_runner run $S $A --prompt "a person talking" --output $W/run.mp4 \
  --runs-root $W/runs > "$OUT/run.txt" 2>&1; echo "rc=$?"; tail -3 "$OUT/run.txt"
cp $W/runs/*/run.json "$OUT/run.json" 2>/dev/null

step "2. batch of two jobs"
printf '%s\n' '{"id": "same", "prompt": "a person talking"}' '{"id": "other", "prompt": "a person singing", "seed": 7}' > $W/jobs.jsonl
timeout -k 5 120 python3 -m wan_s2v_runner batch $S $A --output-dir $W/batch --runs-root $W/bruns \
  $W/jobs.jsonl > "$OUT/batch.txt" 2>&1; echo "rc=$?"; tail -4 "$OUT/batch.txt"; ls $W/batch
( cd $W && sha256sum run.mp4 batch/same.mp4 batch/other.mp4 ) | tee "$OUT/compare.txt"
echo "run == batch's same job: $( [ "$(sha256sum < $W/run.mp4)" = "$(sha256sum < $W/batch/same.mp4)" ] && echo yes || echo NO )" | tee -a "$OUT/compare.txt"

step "3. serve, two jobs over HTTP"
timeout -k 5 150 python3 bench/gpu_serve.py --ckpt $W/demo/tiny-s2v-ckpt --out $W/serve --jobs 2 --size 64*64 \
  --steps 2 --infer-frames 8 --audio-seconds 1 --json "$OUT/serve.json" -- --device cuda --nproc 1 \
  > "$OUT/serve.txt" 2>&1; echo "rc=$?"; grep -v -i warn "$OUT/serve.txt" | tail -14

step "4. warm agent on CUDA, one round"
timeout -k 5 120 python3 bench/gpu_forked.py --preset tiny --rounds 1 --json "$OUT/forked.json" \
  > "$OUT/forked.txt" 2>&1; echo "rc=$?"; grep -v -i warn "$OUT/forked.txt" | tail -12
pkill -f wan_s2v_runner; echo "total $(( $(date +%s) - T0 )) s"
