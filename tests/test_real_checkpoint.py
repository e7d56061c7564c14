"""The real-size random checkpoint's code path (demo/real_checkpoint.py), at small sizes.

The GPU measurement of issue #29 runs `wan-s2v run` on a checkpoint this builder writes at the
real sizes (~46 GB, only on a GPU machine). Here the same code writes a small one with a shard
limit that splits the DiT over several safetensors shards and an index, as the release does:
the runner's preflight reads its sizes, its lean loading reads every shard, and our loop makes
frames from it. At the real sizes, the parameter counts the builder would write (counted on meta)
are the release's.
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch
from conftest import cpu_engine, one_process_frames

from wan_s2v_runner.demo.real_checkpoint import REAL, SMALL, _shards, build_real_checkpoint
from wan_s2v_runner.shared.ckpt_layout import DIT_INDEX, TINY_INFO_FILE


def test_shards_keep_order_and_limit():
    assert _shards([("a", 3), ("b", 3), ("c", 9), ("d", 1)], 6) == [["a", "b"], ["c"], ["d"]]


def test_small_sizes_load_and_generate(tiny_assets, tmp_path):
    from wan_s2v_runner.preflight.memory import sizes_from_checkpoint

    ckpt = build_real_checkpoint(tmp_path / "ckpt", device="cpu", sizes=SMALL, log=lambda _: None)
    index = json.loads((ckpt / DIT_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((ckpt / s).is_file() for s in shards), shards
    info = json.loads((ckpt / TINY_INFO_FILE).read_text())
    sizes = sizes_from_checkpoint(ckpt)
    assert sizes.dit_params == info["dit"]["params"] and sizes.dim == 64 and sizes.num_layers == 2
    assert sizes.t5_params == info["t5"]["params"]
    assets = SimpleNamespace(ckpt_dir=ckpt, image=tiny_assets.image, audio=tiny_assets.audio)
    with cpu_engine(assets) as engine:
        frames = one_process_frames(engine, num_clips=1)
    assert frames.shape[:2] == (3, 5) and torch.isfinite(frames).all()


def test_real_sizes_are_the_release():
    """Counted on meta: what build_real_checkpoint writes at REAL sizes, parameter for parameter."""
    from wan.modules.s2v.model_s2v import WanModel_S2V
    from wan.modules.t5 import T5Encoder

    from wan_s2v_runner.demo.random_weights import dit_kwargs, on_meta
    from wan_s2v_runner.demo.tiny_checkpoint import T5_NUM_BUCKETS, T5_TEXT_DIM, _wan
    from wan_s2v_runner.preflight.memory import REFERENCE

    wan = _wan()
    with on_meta():
        dit = WanModel_S2V(**dit_kwargs(wan, **REAL.dit))
        t5 = T5Encoder(vocab=REAL.t5["vocab"], dim=T5_TEXT_DIM, num_buckets=T5_NUM_BUCKETS, shared_pos=False,
                       **{k: v for k, v in REAL.t5.items() if k != "vocab"})
    n_dit = sum(p.numel() for p in dit.parameters())
    n_t5 = sum(p.numel() for p in t5.parameters())
    assert math.isclose(n_dit, REFERENCE.dit_params, rel_tol=0.01), n_dit
    assert math.isclose(n_t5, REFERENCE.t5_params, rel_tol=0.01), n_t5
    assert math.ceil(n_dit * 2 / REAL.shard_bytes) == 4  # four shards, like the release
