"""Patch: read the T5 encoder's and the VAE's sizes from the checkpoint files being loaded.

Upstream: ``wan.modules.t5.T5EncoderModel.__init__`` builds its model with
``umt5_xxl(encoder_only=True, ...)``, which has the umt5-xxl shape baked in (vocab 256384,
dim 4096, dim_attn 4096, dim_ffn 10240, 64 heads, 24 layers, 32 buckets: 5.7B parameters) and
then ``load_state_dict``s the file strictly. ``wan.modules.vae2_1._video_vae`` likewise
hard-codes the VAE width ``dim=96``. The file contents never inform the shapes.
Change: any checkpoint's dimensions are read from its own files, so a checkpoint whose T5/VAE
differ in size (our tiny test checkpoint, a future variant) loads instead of failing after
allocating a 5.7B model. ``T5EncoderModel.__init__`` is wrapped to make its ``checkpoint_path``
visible (a context variable, for the duration of the call) to a rebound module global
``wan.modules.t5.umt5_xxl``, which reads the sizes from the file's tensor shapes and passes them
on to the original ``umt5_xxl``; ``wan.modules.vae2_1._video_vae`` (looked up as a module global
by ``Wan2_1_VAE``) is rebound to read ``dim`` from the VAE state dict and to check ``z_dim``.
Shapes come from ``torch.load(path, mmap=True, weights_only=True)``, which maps the file and
reads no tensor data (milliseconds even for the 11 GB T5 file). For the real Wan2.2-S2V-14B
files the values read equal the upstream constants (``UPSTREAM_T5``/``UPSTREAM_VAE``), so the
models built are exactly the upstream ones. No engine file is edited; ``apply`` is idempotent.
Proof: tests/test_tiny_checkpoint.py loads T5EncoderModel, Wan2_1_VAE and WanModel_S2V from a
tiny checkpoint with non-default sizes after ``apply`` and checks the sizes, and shows that the
unpatched ``_video_vae`` fails on the same file with a size mismatch and that the unpatched T5
shape differs from what the file holds.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import re
from types import ModuleType
from typing import Any, Optional

from patches.patch import ORIGINAL, Patch, always, unbind

#: umt5_xxl(...) sizes upstream, under the names read_t5_dims returns.
UPSTREAM_T5 = dict(vocab_size=256384, dim=4096, dim_attn=4096, dim_ffn=10240, num_heads=64,
                   num_layers=24, num_buckets=32, shared_pos=False)
#: _video_vae(...) sizes upstream (z_dim comes from Wan2_1_VAE's default, 16).
UPSTREAM_VAE = dict(dim=96, z_dim=16)

_MARK = "_wan_s2v_checkpoint_dims"
_T5_PATH: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "wan_s2v_t5_checkpoint_path", default=None)


class CheckpointLayoutError(ValueError):
    """A checkpoint file does not have the keys/shapes of the expected model."""


def _load_shapes(path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a plain state-dict file, without reading the tensor data. (torch is imported
    here, not at the top: the launcher's checks use this module's shape rules without torch.)"""
    import torch

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        # Legacy (non-zip) torch.save format cannot be mapped; fall back to a full read.
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise CheckpointLayoutError(f"{path}: expected a state dict, got {type(sd).__name__}")
    shapes = {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    del sd
    return shapes


def _need(shapes: dict, key: str, path, what: str) -> tuple[int, ...]:
    if key not in shapes:
        raise CheckpointLayoutError(f"{path} is not a {what} state dict (no key {key!r})")
    return shapes[key]


def read_t5_dims(path) -> dict[str, Any]:
    """Sizes of a umt5 encoder state dict (the layout of ``ckpt_layout.T5_FILE``).

    Returns ``vocab_size, dim, dim_attn, dim_ffn, num_heads, num_layers, num_buckets,
    shared_pos``; for the real file this equals ``UPSTREAM_T5``.
    """
    return t5_dims_from_shapes(_load_shapes(path), path)


def t5_dims_from_shapes(shapes: dict[str, tuple[int, ...]], source="state dict") -> dict[str, Any]:
    """``read_t5_dims`` on a ``{key: shape}`` mapping."""
    what = "umt5 encoder"
    vocab_size, dim = _need(shapes, "token_embedding.weight", source, what)
    layer_ids = {int(m.group(1)) for k in shapes if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not layer_ids or layer_ids != set(range(len(layer_ids))):
        raise CheckpointLayoutError(f"{source}: {what} blocks are missing or not numbered 0..N-1")
    dim_attn = _need(shapes, "blocks.0.attn.q.weight", source, what)[0]
    dim_ffn = _need(shapes, "blocks.0.ffn.fc1.weight", source, what)[0]
    shared_pos = "pos_embedding.embedding.weight" in shapes
    pos_key = ("pos_embedding.embedding.weight" if shared_pos
               else "blocks.0.pos_embedding.embedding.weight")
    num_buckets, num_heads = _need(shapes, pos_key, source, what)
    if dim_attn % num_heads:
        raise CheckpointLayoutError(
            f"{source}: dim_attn {dim_attn} is not a multiple of num_heads {num_heads}")
    return dict(vocab_size=int(vocab_size), dim=int(dim), dim_attn=int(dim_attn),
                dim_ffn=int(dim_ffn), num_heads=int(num_heads), num_layers=len(layer_ids),
                num_buckets=int(num_buckets), shared_pos=bool(shared_pos))


def read_vae_dims(path) -> dict[str, int]:
    """``dim`` (base width) and ``z_dim`` of a Wan2.1 VAE state dict (``ckpt_layout.VAE_FILE``).

    For the real file this equals ``UPSTREAM_VAE``.
    """
    return vae_dims_from_shapes(_load_shapes(path), path)


def vae_dims_from_shapes(shapes: dict[str, tuple[int, ...]], source="state dict") -> dict[str, int]:
    """``read_vae_dims`` on a ``{key: shape}`` mapping."""
    what = "Wan2.1 VAE"
    dim = _need(shapes, "encoder.conv1.weight", source, what)[0]  # CausalConv3d(3, dim, 3)
    z_dim = _need(shapes, "conv2.weight", source, what)[0]  # CausalConv3d(z_dim, z_dim, 1)
    return dict(dim=int(dim), z_dim=int(z_dim))


def _t5_kwargs_from_file(path: str) -> dict[str, Any]:
    d = read_t5_dims(path)
    return dict(vocab_size=d["vocab_size"], dim=d["dim"], dim_attn=d["dim_attn"],
                dim_ffn=d["dim_ffn"], num_heads=d["num_heads"], encoder_layers=d["num_layers"],
                num_buckets=d["num_buckets"], shared_pos=d["shared_pos"])


def apply(wan_module: ModuleType) -> None:
    """Rebind ``umt5_xxl``/``_video_vae`` and wrap ``T5EncoderModel.__init__``. Idempotent."""
    t5 = wan_module.modules.t5
    vae = wan_module.modules.vae2_1

    if not getattr(t5.umt5_xxl, _MARK, False):
        original_umt5_xxl = t5.umt5_xxl

        @functools.wraps(original_umt5_xxl)
        def umt5_xxl(**kwargs):
            path = _T5_PATH.get()
            if path is not None:
                # Sizes from the file; anything the caller passes explicitly still wins.
                kwargs = {**_t5_kwargs_from_file(path), **kwargs}
            return original_umt5_xxl(**kwargs)

        setattr(umt5_xxl, _MARK, True)
        setattr(umt5_xxl, ORIGINAL, original_umt5_xxl)
        t5.umt5_xxl = umt5_xxl

    cls = t5.T5EncoderModel
    if not getattr(cls.__init__, _MARK, False):
        original_init = cls.__init__
        signature = inspect.signature(original_init)

        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            path = bound.arguments.get("checkpoint_path")
            token = _T5_PATH.set(os.fspath(path) if path is not None else None)
            try:
                original_init(self, *args, **kwargs)
            finally:
                _T5_PATH.reset(token)

        setattr(__init__, _MARK, True)
        setattr(__init__, ORIGINAL, original_init)
        cls.__init__ = __init__

    if not getattr(vae._video_vae, _MARK, False):
        original_video_vae = vae._video_vae

        @functools.wraps(original_video_vae)
        def _video_vae(pretrained_path=None, z_dim=None, device="cpu", **kwargs):
            if pretrained_path is not None and "dim" not in kwargs:
                dims = read_vae_dims(pretrained_path)
                if z_dim is not None and dims["z_dim"] != z_dim:
                    raise CheckpointLayoutError(
                        f"{pretrained_path}: VAE z_dim is {dims['z_dim']}, the engine expects "
                        f"{z_dim} (Wan2_1_VAE's latent statistics are 16-channel)")
                kwargs["dim"] = dims["dim"]
            return original_video_vae(pretrained_path=pretrained_path, z_dim=z_dim,
                                      device=device, **kwargs)

        setattr(_video_vae, _MARK, True)
        setattr(_video_vae, ORIGINAL, original_video_vae)
        vae._video_vae = _video_vae


@contextlib.contextmanager
def t5_checkpoint(path):
    """While inside, the patched ``umt5_xxl`` takes its sizes from ``path`` (what the wrapped
    ``T5EncoderModel.__init__`` does for its own call; lean loading builds the T5 itself)."""
    token = _T5_PATH.set(os.fspath(path))
    try:
        yield
    finally:
        _T5_PATH.reset(token)


def is_applied(wan_module: ModuleType) -> bool:
    t5 = wan_module.modules.t5
    return all(getattr(f, _MARK, False) for f in (
        t5.umt5_xxl, t5.T5EncoderModel.__init__, wan_module.modules.vae2_1._video_vae))


def restore(wan_module: ModuleType) -> bool:
    """Undo :func:`apply`: upstream's ``umt5_xxl``, ``T5EncoderModel.__init__`` and ``_video_vae``."""
    t5, vae = wan_module.modules.t5, wan_module.modules.vae2_1
    undone = [unbind(owner, name, _MARK) for owner, name in
              ((t5, "umt5_xxl"), (t5.T5EncoderModel, "__init__"), (vae, "_video_vae"))]
    return any(undone)


def _for_run(wan_module, ctx) -> str:
    apply(wan_module)
    return "T5/VAE sizes read from the checkpoint files"


PATCH = Patch("checkpoint_dims", applies=always, apply=_for_run, restore=restore)
