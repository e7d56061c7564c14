"""Engine patches: small, named, tested changes to the official ``wan`` code, applied at run time.

The engine's files are never edited. Each module here says what upstream does, why we change
it, and which test proves it. Two apply before ``import wan`` (see ``wan_s2v_runner.loading.engine``):
``torchvision_cpu`` and ``t5_import_device``. The rest apply after import, per run: each declares
itself as a :class:`~patches.patch.Patch` (when a run needs it, how it applies and describes
itself, how it is undone), :func:`registry` lists them in order and :func:`apply_for_run` applies
those a run needs, returning what each did (recorded in the run manifest); with
``--compile`` the worker applies ``compile_blocks`` after them and keeps its object (the stage
its compiles are timed in).

What a patch needs of the loader (the LoRA merge) the rank gives it in its
:class:`~patches.patch.PatchContext`: the loader imports patches, never the other way.

May import: shared (a folder of wan_s2v_runner).
"""
from __future__ import annotations

import logging

log = logging.getLogger("wan_s2v.patches")


#: the post-import patches, in the order they apply (each module's ``PATCH``)
REGISTRY_ORDER = ("checkpoint_dims", "attention", "audio_load", "sp_dtype", "local_audio", "fsdp_no_sync",
                  "lora_merge", "cpu_device")


def registry() -> list:
    """The post-import patches as :class:`~patches.patch.Patch` objects, in :data:`REGISTRY_ORDER`
    (imported when asked: a patch module imports torch and the engine's neighbours)."""
    import importlib

    return [importlib.import_module(f"{__name__}.{name}").PATCH for name in REGISTRY_ORDER]


def apply_for_run(wan, spec, param_dtype, on_event=None, on_event_data=None, merge_loras=None) -> dict:
    """Apply the post-import patches a run needs, in the registry's order. Returns {patch name:
    what it did} (``run.json``'s ``patches``). ``on_event`` enters a stage; ``on_event_data(kind,
    **data)`` records an informational event; ``merge_loras``: the run's LoRAs merged into a loaded
    DiT (``wan_s2v_runner.loading.lora.merger``; needed when the spec has LoRAs)."""
    from .patch import PatchContext

    ctx = PatchContext(spec, param_dtype, on_event, on_event_data, merge_loras)
    return {p.name: p.apply(wan, ctx) for p in registry() if p.applies(ctx)}
