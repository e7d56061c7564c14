"""wav2vec2's audio features on the GPU against upstream's CPU (issue #60, part 3): seconds and distance.

Loads the checkpoint's wav2vec2 (the engine's ``AudioEncoder``), encodes the same speech the way
upstream's ``WanS2V.encode_audio`` does (all 25 hidden states, interpolated to the video's rate,
bucketed per frame), once on the CPU (upstream's placement, fp32) and once with the runner's GPU
placement (``rank.encoders.audio_encoder_on``: fp32 on the GPU, cuDNN's TF32 off): the seconds of
each, the features' max and mean absolute difference in fp32, and in the DiT's dtype (bf16 on
CUDA: the share of values that round differently).

    python bench/gpu_audio.py --ckpt /tmp/s2v-random --json audio.json
    python bench/gpu_audio.py --ckpt ~/.cache/wan-s2v/demo/ckpt --device cpu    # smoke test (CPU twice)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--audio-seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    import torch

    from wan_s2v_runner.demo.synthetic_inputs import make_speech_audio
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.rank.encoders import audio_encoder_on, placement
    from wan_s2v_runner.shared.ckpt_layout import WAV2VEC_DIR

    wan = import_wan()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    enc = wan.modules.s2v.audio_encoder.AudioEncoder(model_id=str(a.ckpt / WAV2VEC_DIR))
    speech = make_speech_audio(Path(tempfile.mkdtemp()) / "speech.wav", seconds=a.audio_seconds)

    def features():
        with torch.no_grad():
            z = enc.extract_audio_feat(str(speech), return_all_layers=True)
            bucket, _ = enc.get_audio_embed_bucket_fps(z, fps=16, batch_frames=80, m=0)
        return bucket.float().cpu()

    features()  # warm: librosa, the processor
    t0 = time.perf_counter()
    cpu = features()
    cpu_s = time.perf_counter() - t0
    where, why = placement(enc, device, str(speech))
    with audio_encoder_on(enc, where, device):
        features()  # the first GPU call pays cuDNN's and cuBLAS's start
        t0 = time.perf_counter()
        gpu = features()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        gpu_s = time.perf_counter() - t0
    d = (gpu - cpu).abs()
    low = torch.bfloat16
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "audio_seconds": a.audio_seconds,
           "placement": {"where": where.value, "why": why}, "cpu_s": round(cpu_s, 3), "gpu_s": round(gpu_s, 3),
           "shape": list(cpu.shape), "mean_magnitude": float(cpu.abs().mean()),
           "fp32_max_abs": float(d.max()), "fp32_mean_abs": float(d.mean()),
           "bf16_values_differing": float((gpu.to(low) != cpu.to(low)).float().mean()),
           "back_on_cpu": next(enc.model.parameters()).device.type == "cpu"}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
