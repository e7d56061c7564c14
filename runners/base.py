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

        from wan_s2v_runner.loading import components
        from wan_s2v_runner.shared.layout import dit_load_overlap

        lay = spec.layout
        applied = {}
        if lay.use_sp:
            from patches import ulysses_sp
            bound = len(ulysses_sp.apply(plan.sp_group))
        overlap, why = dit_load_overlap(lay, device.type, spec.load)
        load_group = self._load_group(spec, overlap)
        if not plan.needs_dit:
            why = "none: this rank runs no denoising step (it decodes)"
        parts = components.load(wan, config, str(spec.ckpt_dir), plan, device, device_id,
                                components.LoadSettings.of(spec, overlap), on_event=on_event, load_group=load_group)
        applied["dit_load"] = why
        if lay.use_sp:
            heads = "/".join(map(str, lay.head_split(parts.dit_attr("num_heads"))))
            applied["ulysses_sp"] = (f"{bound} names bound to the SP group; heads {heads} per rank; "
                                     "sequence padded to a multiple of the degree")
        if plan.needs_dit:
            blocks = len(parts.dit_attr("blocks"))  # components.load caches them (patches.context_cache)
            applied["context_cache"] = f"text embedding and {blocks} blocks' cross-attention k/v once per context"
        return parts, applied

    @staticmethod
    def _load_group(spec: GroupSpec, overlap: bool):
        """The process group of the DiT's load, or None (the default group): one of its own where it
        is read on a thread while the encoders' collectives run (gloo), and one of the ranks that
        hold a DiT where some hold none (a 5-rank live pipeline's decoding rank). Every rank makes it."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        holders = [r for r in range(dist.get_world_size()) if spec.layout.holds_dit(r)]
        partial = len(holders) < dist.get_world_size()
        if overlap:
            return dist.new_group(ranks=holders if partial else None, backend="gloo",
                                  timeout=timedelta(seconds=spec.pg_timeout_s))
        if partial:
            return dist.new_group(ranks=holders, timeout=timedelta(seconds=spec.pg_timeout_s))
        return None

