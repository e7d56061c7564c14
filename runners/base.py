"""What every mode runner provides: its mode, what that mode does to the engine (from
:data:`wan_s2v_runner.layout.MODES`), and one spawn path (``launch.run``)."""
from __future__ import annotations

from dataclasses import dataclass

from wan_s2v_runner.layout import MODES, Mode, ModeTraits
from wan_s2v_runner.spec import RunSpec


@dataclass(frozen=True)
class ModeRunner:
    mode: Mode

    @property
    def traits(self) -> ModeTraits:
        return MODES[self.mode]

    @property
    def summary(self) -> str:
        return self.traits.summary

    def engine_kwargs(self, spec: RunSpec) -> dict:
        """Keyword arguments for ``wan.WanS2V(...)`` in this mode, from the spec's layout."""
        lay = spec.layout
        return dict(use_sp=lay.use_sp, dit_fsdp=lay.dit_fsdp, t5_fsdp=lay.t5_fsdp, t5_cpu=lay.t5_cpu)

    def launch(self, spec: RunSpec, **kwargs) -> int:
        """Spawn ``python -m torch.distributed.run`` for this mode and supervise it."""
        from wan_s2v_runner import launch
        if spec.mode is not self.mode:
            spec = spec.model_copy(update={"mode": self.mode})
        return launch.run(spec, **kwargs)
