"""Check ``ckpt.t5_file``: a ``--t5-file`` is a UMT5 encoder we can read, and the checkpoint's T5.
It reads the file's header only (and the few bytes of any ``comfy_quant`` record; see
:mod:`wan_s2v_runner.loading.t5_file`): the naming recognised and mapped to wan's, every tensor
of the encoder present with consistent shapes, the storage format named, the dims compared with
the checkpoint's T5 (its ``.pth`` when CKPT_DIR has one). The tensor table it finds stands in for
the ``.pth``'s in the checks after it (the DiT's text width, the tokenizer's vocabulary) and in
the memory plan. Runs after ``ckpt.pth``, whose T5 dims it compares with.
"""
from __future__ import annotations

from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError
from wan_s2v_runner.loading.dit_file import DitFileError
from wan_s2v_runner.loading.t5_file import FIX_FILE, config_mismatch, describe_dims, inspect, reference_dims
from wan_s2v_runner.shared.ckpt_layout import T5_FILE
from wan_s2v_runner.shared.layout import LoadStrategy

from .core import fail, ok, skip

ID = "ckpt.t5_file"


def check_t5_file(ctx):
    path = ctx.spec.t5_file
    if path is None:
        return skip(ID, "no --t5-file (T5 comes from CKPT_DIR)")
    if ctx.spec.load is LoadStrategy.FULL:
        return fail(ID, "--t5-file is read by lean loading (--load full is upstream's own reading of CKPT_DIR's "
                    f"{T5_FILE})", "drop --load full (or --t5-file)", file=str(path))
    try:
        layout = inspect(path)
    except DitFileError as e:
        return fail(ID, e.cause, e.fix, file=str(path))
    except (CheckpointFileError, OSError) as e:
        return fail(ID, f"--t5-file {e}", "the file is incomplete or not safetensors: download it again",
                    file=str(path))
    dims = layout.dims
    st = ctx.cache.setdefault("ckpt", {})
    if "t5_dims" in st:  # ckpt.pth read CKPT_DIR's .pth
        ref, where = st["t5_dims"], f"CKPT_DIR's {T5_FILE}"
    else:
        ref, where = reference_dims(ctx.spec.ckpt_dir)
    cause = config_mismatch(dims, ref, where)
    if cause:
        return fail(ID, f"{path.name}: {cause}", FIX_FILE, file=str(path))
    st["t5_shapes"] = {k: (s, layout.dtypes[k]) for k, s in layout.shapes.items()}
    st["t5_dims"] = dims
    return ok(ID, f"{layout.describe()}; as {where}", format=layout.format.value, naming=layout.naming,
              dims=describe_dims(dims))
