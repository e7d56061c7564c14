#!/bin/bash
# Issue #60's device session, in three calls on one warm machine (docs/gpu.md, "FA4 against cuDNN" and
# "A warm 5-s video"). What must travel (about 160 MB: the pipeline's and the server's wheels, an
# ffmpeg, flash-attn-4 with the CuTe DSL's 92 MB CUDA 13 libraries) is more than one call may carry
# (64 MiB), so it goes in three parts from .dev/ (ignored through .git/info/exclude; made by
# `bash bench/gpu_session_warm.sh pack`), kept under /tmp/keep on the machine between calls:
#   prep   (.dev/a: wheels, imageio_ffmpeg without its binary + an xz'd ffmpeg): installs them, checks the
#          imports, and starts writing the ~46 GB random checkpoint in the background (its own session,
#          so it runs on past the call while the next parts travel);
#   carry  (.dev/b: the first half of the CUDA 13 libraries' wheel): kept;
#   main   (.dev/c: the second half): installs flash-attn-4; then, each bounded by what is left of
#          BUDGET: one attention call at the real shapes per backend (SDPA's cuDNN kernel, FA4) with
#          its distance from fp32, and FA4 under torch.compile; the checkpoint awaited; the real-size
#          step eager with SDPA, then FA4, then FA4 compiled; wav2vec2's features on the GPU against the
#          CPU's; and `wan-s2v serve` with two 5-s jobs of the few-step settings (4 steps, CFG 1,
#          --compile, fp8), each job's wall against its stages.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
K=/tmp/keep; CKPT=${CKPT:-/tmp/s2v-random}
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
env_paths() {
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages IMAGEIO_FFMPEG_EXE=/tmp/ffmpeg
}
case "${1:-}" in
pack)  # here, before the session: .dev/{a,b,c} from the wheels in WHEELS (pipeline) and FA4_WHEELS, FFMPEG_XZ
  rm -rf .dev; mkdir -p .dev/a/fa4 .dev/b .dev/c
  cp "${WHEELS:?}"/*.whl .dev/a/; cp "${FFMPEG_XZ:?}" .dev/a/ffmpeg.xz; cp -r "${IMAGEIO_FFMPEG_PY:?}" .dev/a/imageio_ffmpeg
  for f in "${FA4_WHEELS:?}"/*.whl; do [ "$(basename "$f")" = "$CU13" ] || cp "$f" .dev/a/fa4/; done
  split -n 2 -d "$FA4_WHEELS/$CU13" .dev/cu13.part; mv .dev/cu13.part00 .dev/b/; mv .dev/cu13.part01 .dev/c/
  (cd "$FA4_WHEELS" && sha256sum "$CU13") > .dev/c/cu13.sha256
  du -sh .dev/*; exit 0 ;;
prep)
  T0=$(date +%s); mkdir -p $K; cp -r .dev/a/. $K/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $K/*.whl || exit 3
  cp -r $K/imageio_ffmpeg /tmp/site/ && python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('$K/ffmpeg.xz'), open('/tmp/ffmpeg', 'wb'))" \
    && chmod +x /tmp/ffmpeg || exit 3
  env_paths
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys,torch,transformers,diffusers,triton;print(sys.version);print('torch',torch.__version__,'cuda',torch.version.cuda,'cudnn',torch.backends.cudnn.version(),'transformers',transformers.__version__,'diffusers',diffusers.__version__,'triton',triton.__version__)"
    /tmp/ffmpeg -version | head -1; df -h /tmp | tail -1; nproc; free -g | sed -n 2p; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  python3 -c "import sys; sys.path.insert(0,'.'); from wan_s2v_runner.loading.engine import import_wan; import_wan(); import fastapi, uvicorn, imageio_ffmpeg; from wan_s2v_runner.serve import app; print('engine and server import; ffmpeg', imageio_ffmpeg.get_ffmpeg_exe())" || exit 4
  setsid nohup bash -c "python3 -m wan_s2v_runner.demo.real_checkpoint $CKPT --device cuda > $K/checkpoint.txt 2>&1; echo rc=\$? >> $K/checkpoint.txt" > /dev/null 2>&1 < /dev/null &
  echo "prep done in $(( $(date +%s) - T0 )) s; the checkpoint is being written in the background"; exit 0 ;;
carry)
  mkdir -p $K; cp .dev/b/* $K/; ls -la $K | tail -4; tail -3 $K/checkpoint.txt 2>/dev/null; exit 0 ;;
main) ;;
*) echo "usage: $0 pack|prep|carry|main"; exit 2 ;;
esac

BUDGET=${BUDGET:-540}; T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
env_paths; REPO=$PWD
cat $K/cu13.part00 .dev/c/cu13.part01 > $K/fa4/$CU13
(cd $K/fa4 && sha256sum -c "$REPO/.dev/c/cu13.sha256") || echo "cu13 wheel checksum FAILED"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $K/fa4/*.whl \
  || echo "FA4 wheels did not install"
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|nvidia-cutlass|cuda-bindings|cuda-python) " > "$OUT/versions.txt"
python3 -c "import flash_attn.cute as f, cutlass; print('flash_attn.cute', f.__version__, 'cutlass', cutlass.__version__)" \
  >> "$OUT/versions.txt" 2>&1; cat "$OUT/versions.txt"

echo "== attention at the real shapes ($(left) s left)"
timeout -k 5 120 python3 bench/gpu_attention.py --backends sdpa,fa4 --compile-check --json "$OUT/attention.json" 2>&1 \
  | grep -v -i "warn" | tail -12

echo "== waiting for the checkpoint ($(left) s left)"
timeout 150 bash -c "until grep -q '^rc=' $K/checkpoint.txt 2>/dev/null; do sleep 2; done"; tail -7 $K/checkpoint.txt
cp $K/checkpoint.txt "$OUT/" 2>/dev/null

echo "== the real-size step: SDPA, FA4, FA4 compiled ($(left) s left)"
TORCH_LOGS=recompiles timeout -k 5 $(( $(left) - 250 )) python3 bench/gpu_step.py --attention sdpa --attention-also fa4 \
  --compile blocks --warmup 1 --repeat 1 --json "$OUT/step-fa4.json" > "$OUT/step-fa4.txt" 2>&1
echo "rc=$?"; grep -v -i "warning\|autocast\|warn(" "$OUT/step-fa4.txt" | tail -16

echo "== wav2vec2 on the GPU against the CPU ($(left) s left)"
timeout -k 5 60 python3 bench/gpu_audio.py --ckpt "$CKPT" --json "$OUT/audio.json" 2>&1 | grep -v -i warn | tail -6

echo "== serve: two 5-s jobs, 4 steps, CFG 1, --compile, fp8 ($(left) s left)"
timeout -k 10 $(( $(left) - 10 )) python3 bench/gpu_serve.py --ckpt "$CKPT" --out /tmp/gs --jobs 2 --json "$OUT/serve.json" \
  --load-timeout 240 --job-timeout 240 -- --device cuda --nproc 1 --compile --dit-quant fp8 --no-offload-model \
  --skip-preflight 2>&1 | tail -12
cp /tmp/gs/serve.log "$OUT/" 2>/dev/null
pkill -f "wan_s2v_runner serve"; echo "total $(( $(date +%s) - T0 )) s"
