"""Check ``ckpt.dit_file``: a ``--dit-file`` is a DiT we can read, and the S2V model that
``CKPT_DIR/config.json`` builds. It reads the file's header only (and the few bytes of any
``comfy_quant`` record; see :mod:`wan_s2v_runner.loading.dit_file`). The tensor table it finds
stands in for the directory's DiT files in the checks after it (config dims, sub-models, LoRAs)
and in the memory plan.
"""
from __future__ import annotations

import json
import math

from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError
from wan_s2v_runner.loading.dit_file import FIX_FILE, DitFileError, config_mismatch, inspect
from wan_s2v_runner.shared.ckpt_layout import DIT_CONFIG

from .core import fail, ok, skip


def check_dit_file(ctx):
    path = ctx.spec.dit_file
    if path is None:
        return skip("ckpt.dit_file", "no --dit-file (the DiT comes from CKPT_DIR)")
    try:
        layout = inspect(path)
    except DitFileError as e:
        return fail("ckpt.dit_file", e.cause, e.fix, file=str(path))
    except (CheckpointFileError, OSError) as e:
        return fail("ckpt.dit_file", f"--dit-file {e}", "the file is incomplete or not safetensors: download "
                    "it again", file=str(path))
    arch = layout.architecture
    cfg = None
    if ctx.spec.ckpt_dir is not None:
        try:
            cfg = json.loads((ctx.spec.ckpt_dir / DIT_CONFIG).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            cfg = None  # ckpt.config reports it
    cause = config_mismatch(arch, cfg if isinstance(cfg, dict) else {})
    if cause:
        return fail("ckpt.dit_file", f"{path.name}: {cause}", FIX_FILE, file=str(path))
    st = ctx.cache.setdefault("ckpt", {})
    st["dit_tensors"] = {k: math.prod(s) for k, s in layout.shapes.items()}
    st["dit_shapes"] = dict(layout.shapes)
    return ok("ckpt.dit_file", f"{layout.describe()}; {arch.describe()}", format=layout.format.value,
              prefix=layout.prefix, dit_params=sum(st["dit_tensors"].values()))
