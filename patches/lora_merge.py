"""Patch: merge the run's LoRAs into the DiT right after it is loaded, before any sharding.

Upstream: ``WanS2V.__init__`` loads the DiT with ``WanModel_S2V.from_pretrained`` (on the rank's
device, or on the CPU when it will be FSDP-sharded) and hands it to ``self._configure_model``,
which rebinds the Ulysses attention forwards and FSDP-wraps it; the S2V pipeline has no LoRA
support at all.
Change: wrap ``WanS2V._configure_model`` so that it first merges the LoRAs into the model it is
given (the merge the rank hands the patch, :func:`wan_s2v_runner.loading.lora.merger`: fp32
accumulation on the weight's device, rounded once to the weight's dtype), then calls upstream's.
Sharding, Ulysses and the FSDP weight fingerprint therefore see plain, merged weights: no mode
needs a LoRA code path, and a LoRA costs nothing per step. With no LoRA in the spec the patch
is not applied. Under lean loading an FSDP DiT arrives here still on the meta device (its shards
are read after wrapping): the patch leaves it to the loader, which checked the LoRAs against its
shapes before (a :class:`~wan_s2v_runner.loading.lora.LoraDeltas`, ``loading/components.py``)
and adds each delta to the slices the rank holds once they are filled
(``lean_load.merge_deltas_into_shards``) — element for element the same merge.
Proof: tests/test_lora.py (merged DiT == peft's un-merged adapter on the same DiT; strength 0 ==
no LoRA; the three formats give the same frames; fsdp-fixed and hybrid at 2 ranks == 1 process).
"""
from __future__ import annotations

import functools
import logging

from patches.patch import ORIGINAL, Patch, unbind

log = logging.getLogger("wan_s2v.lora")
_MARK = "_wan_s2v_lora_merge"
#: set (True) on a DiT whose weights already hold the LoRAs (a streamed DiT mapped from its
#: page-cache file, written with them merged: ``wan_s2v_runner.loading.dit_cache``): not merged again
MERGED = "_wan_s2v_loras_merged"


def apply(wan_module, merge_into, on_merged=None) -> bool:
    """Patch ``WanS2V._configure_model`` to call ``merge_into(model)`` first (the run's LoRAs
    merged into the DiT, returning one record per LoRA: ``wan_s2v_runner.loading.lora.merger``).
    ``on_merged(records)`` receives the records. Returns False if already applied."""
    cls = wan_module.speech2video.WanS2V
    current = cls._configure_model
    if getattr(current, _MARK, False):
        return False

    @functools.wraps(current)
    def _configure_model(self, model, *args, **kwargs):
        if any(p.is_meta for p in model.parameters()):  # lean FSDP: the loader merges into the shards
            return current(self, model, *args, **kwargs)
        if getattr(model, MERGED, False):  # merged as the loader wrote its weights
            return current(self, model, *args, **kwargs)
        records = merge_into(model)
        for r in records:
            log.info("LoRA %s (%s, strength %g): %d modules merged", r["path"], r["format"], r["strength"],
                     r["matched_modules"])
        if on_merged is not None:
            on_merged(records)
        return current(self, model, *args, **kwargs)

    setattr(_configure_model, _MARK, True)
    setattr(_configure_model, ORIGINAL, current)
    cls._configure_model = _configure_model
    return True


def restore(wan_module) -> bool:
    return unbind(wan_module.speech2video.WanS2V, "_configure_model", _MARK)


def _for_run(wan_module, ctx) -> str:
    from wan_s2v_runner.shared.layout import DitQuant

    spec = ctx.spec
    refs = ", ".join(str(ref) for ref in spec.lora)
    if DitQuant(spec.dit_quant) is not DitQuant.NONE:  # merged as the weights are quantized
        return refs + ": merged before quantizing (wan_s2v_runner.loading.quantize)"
    if ctx.merge_loras is None:
        raise ValueError("a run with LoRAs needs their merge in the patch context (merge_loras: "
                         "wan_s2v_runner.loading.lora.merger)")
    on_merged = (lambda records: ctx.on_event_data("lora", loras=records)) if ctx.on_event_data else None
    apply(wan_module, ctx.merge_loras, on_merged=on_merged)
    return refs


PATCH = Patch("lora_merge", applies=lambda ctx: bool(ctx.spec.lora), apply=_for_run, restore=restore)
