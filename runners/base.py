"""What every mode runner provides: its mode, what that mode does to the engine (from
:data:`wan_s2v_runner.shared.layout.MODES`), how a rank prepares for it (:meth:`ModeRunner.prepare`, given
the rank's (cfg, sp) plan: Ulysses on the SP group for any degree (``patches.ulysses_sp``), the engine
parts this rank loads). Spawning a run is the launcher's (``wan_s2v_runner.launcher.launch``), the same for
every mode."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from wan_s2v_runner.shared.layout import MODES, Mode, ModeTraits
from wan_s2v_runner.shared.spec import GroupSpec


@dataclass(frozen=True)
class ModeRunner:
    mode: Mode

    @property
    def traits(self) -> ModeTraits:
        return MODES[self.mode]

    @property
    def summary(self) -> str:
        return self.traits.summary

    def prepare(self, wan, config, spec: GroupSpec, plan, device, device_id: int, on_event=None):
        """On one rank with its ``plan`` (``rank.parallel.rank_plan``: the rank's place on the
        layout's mesh, made by the rank): Ulysses bound to its SP group (any degree) in a
        sequence-parallel mode, and the engine parts the plan needs (DiT sharded/split as the
        layout says; T5, wav2vec2 and VAE only where they run). Returns (parts, patches applied
        here)."""
        import torch.distributed as dist

        from wan_s2v_runner.loading import components
        from wan_s2v_runner.shared.layout import dit_load_overlap

        lay = spec.layout
        applied = {}
        if lay.use_sp:
            from patches import ulysses_sp
            bound = len(ulysses_sp.apply(plan.sp_group))
        overlap, why = dit_load_overlap(lay, device.type, spec.load)
        load_group = None  # the DiT's load's own collectives, apart from the encoders' (every rank makes it)
        if overlap and dist.is_initialized() and dist.get_world_size() > 1:
            load_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec.pg_timeout_s))
        parts = components.load(wan, config, str(spec.ckpt_dir), plan, device, device_id,
                                components.LoadSettings.of(spec, overlap), on_event=on_event, load_group=load_group)
        applied["dit_load"] = why
        if lay.use_sp:
            heads = "/".join(map(str, lay.head_split(parts.dit_attr("num_heads"))))
            applied["ulysses_sp"] = (f"{bound} names bound to the SP group; heads {heads} per rank; "
                                     "sequence padded to a multiple of the degree")
        blocks = len(parts.dit_attr("blocks"))  # components.load caches them (patches.context_cache)
        applied["context_cache"] = f"text embedding and {blocks} blocks' cross-attention k/v once per context"
        return parts, applied

