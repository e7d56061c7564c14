"""A random-weight checkpoint at the real Wan2.2-S2V-14B sizes, in the real layout (issue #29).

For measuring the whole pipeline at real size on a GPU machine that cannot download the model:
the same files as :mod:`.tiny_checkpoint` (whose tokenizer, VAE and wav2vec2 writers it uses), at
the sizes of the real one -- the DiT from the engine's own S2V-14B config (16.3 B parameters,
bf16, four safetensors shards with diffusers' index, like the release), the umt5-xxl encoder
(5.7 B, bf16), the VAE at width 96 (127 M, fp32), wav2vec2-large-xlsr-53's shape (317 M, fp32).
About 46 GB on disk. The DiT and T5 are built on meta and their tensors made on ``device``
(:mod:`.random_weights`), one component at a time, so host memory holds one DiT shard (twice
while safetensors serializes it: ~20 GB) or the T5 state dict (11.4 GB) at a time. The tokenizer is the tiny one
(its ids fit any
vocabulary). Written in a temporary sibling directory, then renamed into place.

    python -m wan_s2v_runner.demo.real_checkpoint OUT_DIR [--device cuda]

:data:`REAL` holds the sizes; ``tests/test_real_checkpoint.py`` builds the same code path at
:data:`SMALL` sizes, several shards, and runs the loop on it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from wan_s2v_runner.shared.ckpt_layout import DIT_INDEX, T5_FILE, TINY_INFO_FILE, VAE_FILE

from . import tiny_checkpoint as tiny
from .random_weights import materialize, on_meta, random_dit

GiB = 2**30


@dataclass(frozen=True)
class CheckpointSizes:
    """Every component's size. ``dit``: WanModel_S2V arguments replacing the S2V-14B config's."""
    dit: dict = field(default_factory=dict)
    t5: dict = field(default_factory=lambda: {"vocab": 256384, "dim_attn": 4096, "dim_ffn": 10240,
                                              "num_heads": 64, "num_layers": 24})
    vae_dim: int = 96
    wav2vec: dict = field(default_factory=lambda: {"hidden": 1024, "heads": 16, "intermediate": 4096,
                                                   "conv_dim": 512})
    shard_bytes: int = 10 * GiB  # the release's 4 DiT shards are ~8-10 GB each


REAL = CheckpointSizes()
#: small sizes of the same structure, several DiT shards: the tests and the CPU smoke test of
#: bench/gpu_pipeline.py (the demo's image and speech fit them)
SMALL = CheckpointSizes(
    dit={"dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2, "audio_inject_layers": [0, 1], "audio_dim": 32},
    t5={"vocab": 384, "dim_attn": 64, "dim_ffn": 64, "num_heads": 4, "num_layers": 1},
    vae_dim=8, wav2vec={"hidden": 32, "heads": 4, "intermediate": 64, "conv_dim": 16}, shard_bytes=2**18)


def _shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most ``limit`` bytes (a bigger tensor alone)."""
    out: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if out[-1] and used + n > limit:
            out.append([])
            used = 0
        out[-1].append(name)
        used += n
    return out


def _write_dit(tmp: Path, wan, sizes: CheckpointSizes, device, seed: int) -> dict:
    """config.json + sharded safetensors + index, like diffusers' save_pretrained of the release."""
    import torch
    from safetensors.torch import save_file

    model, nbytes = random_dit(wan, device, torch.bfloat16, seed, **sizes.dit)
    model.save_config(str(tmp))  # diffusers ConfigMixin: the config.json from_pretrained reads
    sd = model.state_dict()
    groups = _shards([(k, v.numel() * v.element_size()) for k, v in sd.items()], sizes.shard_bytes)
    weight_map = {}
    for i, names in enumerate(groups, 1):
        fname = f"diffusion_pytorch_model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: sd[k].contiguous().cpu() for k in names}, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    (tmp / DIT_INDEX).write_text(json.dumps({"metadata": {"total_size": nbytes}, "weight_map": weight_map},
                                            indent=2) + "\n")
    params = sum(v.numel() for v in sd.values())
    del model, sd
    return {"params": params, "bytes": nbytes, "shards": len(groups)}


def _write_t5(path: Path, wan, t5: dict, device, seed: int) -> dict:
    """The umt5 encoder state dict (bf16, ``torch.save``), built on meta and made on ``device``."""
    import torch
    from wan.modules.t5 import T5Encoder

    with on_meta():
        model = T5Encoder(vocab=t5["vocab"], dim=tiny.T5_TEXT_DIM, dim_attn=t5["dim_attn"], dim_ffn=t5["dim_ffn"],
                          num_heads=t5["num_heads"], num_layers=t5["num_layers"], num_buckets=tiny.T5_NUM_BUCKETS,
                          shared_pos=False, dropout=0.1)
    nbytes = materialize(model, device, torch.bfloat16, seed)
    torch.save({k: v.contiguous().cpu() for k, v in model.state_dict().items()}, path)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"params": params, "bytes": nbytes}


def build_real_checkpoint(out_dir: Path, *, device: str = "cpu", sizes: CheckpointSizes = REAL,
                          seed: int = 0, log=print) -> Path:
    """Write the random checkpoint of ``sizes`` (default: the real ones) to ``out_dir``; tensors of
    the DiT and T5 are made on ``device``. Returns ``out_dir``; never leaves it half-written."""
    import torch

    out_dir = Path(out_dir).absolute()
    wan = tiny._wan()
    dev = torch.device(device)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    info: dict = {"kind": "wan-s2v random checkpoint at given sizes (not a trained model)", "seed": seed,
                  "sizes": asdict(sizes), "torch": torch.__version__, "seconds": {}}
    try:
        steps = (
            ("dit", lambda: _write_dit(tmp, wan, sizes, dev, seed * 1000 + 1)),
            ("t5", lambda: _write_t5(tmp / T5_FILE, wan, sizes.t5, dev, seed * 1000 + 2)),
            ("t5_tokenizer", lambda: tiny._write_t5_tokenizer(tmp, tiny.T5_VOCAB_SIZE)),
            ("vae", lambda: tiny._write_vae(tmp / VAE_FILE, wan, seed=seed * 1000 + 3, dim=sizes.vae_dim)),
            ("wav2vec2", lambda: tiny._write_wav2vec(tmp, wan, seed=seed * 1000 + 4, **sizes.wav2vec)),
        )
        for name, write in steps:
            t0 = time.perf_counter()
            got = write()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            info["seconds"][name] = round(time.perf_counter() - t0, 1)
            if got:
                info[name] = got
            log(f"{name}: {info['seconds'][name]} s" + (f", {got['params'] / 1e9:.3f} B parameters" if got else ""))
        (tmp / TINY_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        tiny._replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Write a random Wan2.2-S2V-14B-sized checkpoint (~46 GB).")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--device", default="cuda", help="where the DiT and T5 tensors are made (default cuda)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.perf_counter()
    got = build_real_checkpoint(a.out_dir, device=a.device, seed=a.seed)
    size = tiny.dir_bytes(got)
    print(f"{got}: {size / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s ({math.ceil(size / GiB)} GiB)")
