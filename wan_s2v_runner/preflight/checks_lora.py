"""Group ``lora``: every ``--lora`` file exists, is a readable safetensors file, is in a known
LoRA format, and every key maps to a module of this DiT with matching shapes (from the file
headers of the LoRA and the checkpoint; nothing is loaded). Unmatched keys fail unless
``--lora-allow-partial`` (a key naming mismatch must never mean a silent "no effect").
"""
from __future__ import annotations

from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError, read_safetensors_header
from wan_s2v_runner.loading.dit_file import dit_shapes
from wan_s2v_runner.loading.lora import plan

from .core import fail, ok, skip, warn


def _dit(ctx):
    known = ctx.cache.get("ckpt", {}).get("dit_shapes")  # ckpt.safetensors / ckpt.dit_file read them
    if "dit_shapes" not in ctx.cache and known is not None:
        ctx.cache["dit_shapes"] = known
    if "dit_shapes" not in ctx.cache:
        try:
            ctx.cache["dit_shapes"] = dit_shapes(ctx.spec.ckpt_dir, ctx.spec.dit_file) if ctx.spec.ckpt_dir else None
        except (CheckpointFileError, OSError):
            ctx.cache["dit_shapes"] = None
    return ctx.cache["dit_shapes"]


def check_loras(ctx):
    loras = ctx.spec.lora
    if not loras:
        return skip("lora.files", "no --lora given")
    out = []
    for ref in loras:
        name = ref.path.name
        if not ref.path.is_file():
            out.append(fail("lora.file", f"{ref.path} does not exist" if not ref.path.exists()
                            else f"{ref.path} is not a file", "pass the LoRA's .safetensors file to --lora"))
            continue
        if ref.path.suffix.lower() != ".safetensors":
            out.append(fail("lora.file", f"{name}: only .safetensors LoRAs are read (a pickled .pt/.ckpt "
                            "can run code when loaded)", "convert it to .safetensors"))
            continue
        try:
            shapes = {k: s for k, (_, s) in read_safetensors_header(ref.path).tensors.items()}
        except (CheckpointFileError, OSError) as e:
            out.append(fail("lora.file", f"{name} does not read as safetensors: {e}",
                            "re-download or re-export the LoRA"))
            continue
        dit = _dit(ctx)
        if dit is None:
            out.append(skip("lora.match", f"{name}: needs a readable --ckpt-dir to match its keys"))
            continue
        p = plan(shapes, dit)
        if not p.matched_modules and not p.unmatched and not p.shape_errors:
            out.append(fail("lora.format", f"{name} is not a LoRA: none of its {len(shapes)} keys is a lora_A/B, "
                            "lora_down/up, alpha or diff tensor", "pass a LoRA file (peft, kohya or ComfyUI keys)"))
            continue
        summary = (f"{name}: {p.format} format, {len(p.matched_modules)} modules matched, "
                   f"{len(p.unmatched)} unmatched, strength {ref.strength:g}")
        data = dict(format=p.format, matched=len(p.matched_modules), unmatched=len(p.unmatched),
                    shape_errors=len(p.shape_errors), unrecognised=len(p.unrecognised))
        if p.refused(allow_partial=True):  # wrong shapes or nothing matched: never runs
            out.append(fail("lora.match", f"{summary}; {'; '.join(p.problems())}",
                            f"likely {p.likely_cause()}; use a LoRA trained for Wan2.2-S2V-14B", **data))
        elif not p.ok:
            partial = ctx.spec.lora_allow_partial
            mk = fail if p.refused(partial) else warn
            fix = ("the unmatched keys are skipped (--lora-allow-partial)" if partial
                   else f"likely {p.likely_cause()}; --lora-allow-partial merges only the matching modules")
            out.append(mk("lora.match", f"{summary}; {'; '.join(p.problems())}", fix, **data))
        else:
            out.append(ok("lora.match", summary, **data))
    return out
