"""Engine patches: small, named, tested changes to the official ``wan`` code, applied at run time.

The engine's files are never edited. Each module here says what upstream does, why we change
it, and which test proves it. Two apply before ``import wan`` (see ``wan_s2v_runner.loading.engine``):
``torchvision_cpu`` and ``t5_import_device``. The rest apply after import, per run, through
:func:`apply_for_run`, which returns the names applied (recorded in the run manifest); with
``--compile`` the worker applies ``compile_blocks`` after them and keeps its object (the stage
its compiles are timed in).

May import: shared, loading (folders of wan_s2v_runner).
"""
from __future__ import annotations

import logging

log = logging.getLogger("wan_s2v.patches")


def apply_for_run(wan, spec, param_dtype, on_event=None, on_event_data=None) -> dict:
    """Apply the post-import patches a run needs. Returns {patch name: detail}. ``on_event`` enters
    a stage; ``on_event_data(kind, **data)`` records an informational event."""
    from wan_s2v_runner.shared.layout import DitQuant

    from . import attention, audio_load, checkpoint_dims, cpu_device, fsdp_no_sync, local_audio, lora_merge, sp_dtype

    on_cpu = spec.device == "cpu"
    applied: dict = {}
    checkpoint_dims.apply(wan)
    applied["checkpoint_dims"] = "T5/VAE sizes read from the checkpoint files"
    backend, reason = attention.resolve_backend(spec.attention, "cpu" if on_cpu else "cuda")
    mods = attention.apply(wan, backend)
    applied["attention"] = f"{backend} ({reason}); {len(mods)} modules"
    log.info("attention backend: %s (%s)", backend, reason)
    audio_load.apply(wan)
    applied["audio_load"] = "16 kHz mono speech read with libsndfile (librosa's first load skipped)"
    sp_dtype.apply(wan, param_dtype)
    applied["sp_dtype"] = str(param_dtype)
    if spec.layout.use_sp:
        local_audio.apply(wan)
        applied["local_audio"] = "audio injection on each rank's own tokens (no all-gather)"
    if spec.layout.dit_fsdp or spec.layout.t5_fsdp:
        fsdp_no_sync.apply(wan, param_dtype=param_dtype, on_cpu=on_cpu, on_event=on_event)
        applied["fsdp_no_sync"] = "sync_module_states=False + weight fingerprint"
    if spec.lora and DitQuant(spec.dit_quant) is not DitQuant.NONE:  # merged as the weights are quantized
        applied["lora_merge"] = (", ".join(str(ref) for ref in spec.lora)
                                 + ": merged before quantizing (wan_s2v_runner.loading.quantize)")
    elif spec.lora:
        lora_merge.apply(wan, spec.lora, allow_partial=spec.lora_allow_partial,
                         on_merged=(lambda records: on_event_data("lora", loras=records)) if on_event_data else None)
        applied["lora_merge"] = ", ".join(str(ref) for ref in spec.lora)
    if on_cpu:
        cpu_device.apply(wan)
        applied["cpu_device"] = "speech2video CUDA calls mapped to CPU"
    return applied
