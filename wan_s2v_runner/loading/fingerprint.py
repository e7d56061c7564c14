"""The fingerprint of checkpoint files: a digest of each file's tensor table (names, dtypes,
shapes) and of one deterministic 64-element window of every tensor (:func:`source_digest`). The
ranks compare it across a group before FSDP runs without a broadcast
(:func:`~.lean_load.verify_same_checkpoint`); a server records it as part of its fleet's
identity (:func:`weights_fingerprint`), so a server with other weights never joins its pool.

It reads a few hundred bytes per tensor (the windows) and each file's header: seconds for the
real checkpoint's 45 GB, however large. A difference confined outside every window goes
unnoticed; a retrained or fine-tuned file differs everywhere.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

from wan_s2v_runner.shared import ckpt_layout


def source_digest(source) -> str:
    """The digest of a :class:`~.ckpt_read.CheckpointSource`: its tensor table and one window of
    every tensor, read as float64."""
    import torch

    from wan_s2v_runner.loading.ckpt_read import sample_windows

    h = hashlib.sha256()
    entries = sorted(source.table().items())
    for key, (dtype, shape) in entries:
        h.update(f"{key}|{dtype}|{tuple(shape)};".encode())
    for key, start, count in sample_windows((k, math.prod(shape)) for k, (_, shape) in entries):
        buf = torch.empty(count, dtype=torch.float64)
        source.read_flat(key, start, buf, purpose="verify")
        h.update(buf.numpy().tobytes())
    return h.hexdigest()


def weights_fingerprint(ckpt_dir: Path, dit_file=None, t5_file=None) -> dict[str, str]:
    """Each weight file's digest in a checkpoint directory: the DiT (``dit_file`` when given), T5
    (``t5_file`` when given),
    the VAE and wav2vec2 (the files :mod:`~wan_s2v_runner.shared.ckpt_layout` names; one missing
    is left out)."""
    from wan_s2v_runner.loading.ckpt_read import PthFile, SafetensorsFiles, open_dit
    from wan_s2v_runner.loading.t5_file import open_t5_file

    ckpt_dir = Path(ckpt_dir)
    out: dict[str, str] = {}
    sources = {"dit": lambda: open_dit(ckpt_dir, dit_file),
               "t5": lambda: (open_t5_file(t5_file) if t5_file is not None
                              else PthFile(ckpt_dir / ckpt_layout.T5_FILE)),
               "vae": lambda: PthFile(ckpt_dir / ckpt_layout.VAE_FILE),
               "wav2vec2": lambda: (SafetensorsFiles([ckpt_dir / ckpt_layout.W2V_WEIGHTS])
                                    if (ckpt_dir / ckpt_layout.W2V_WEIGHTS).is_file()
                                    else PthFile(ckpt_dir / ckpt_layout.W2V_WEIGHTS_BIN))}
    for name, open_source in sources.items():
        try:
            source = open_source()
        except (OSError, ValueError, RuntimeError):
            continue
        try:
            out[name] = source_digest(source)
        finally:
            source.close()
    return out
