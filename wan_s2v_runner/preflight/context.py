"""What checks read: :class:`CheckContext` = a run spec (complete, or the lenient draft the
doctor works on) + the machine's facts + what checks measured for each other.

``run`` builds it from a validated :class:`~wan_s2v_runner.shared.spec.RunSpec` (:meth:`for_spec`).
``doctor`` may have no checkpoint, inputs or prompt, so :meth:`for_values` takes the partial
values (environment, config file, flags), assumes what the machine suggests for ``--device`` and
``--nproc`` when they are not given (recorded in ``notes``), and builds the view with
:func:`wan_s2v_runner.shared.config.draft` — the same fields, defaults and validators as a run, not a second list.
Checks read settings from ``ctx.spec`` (missing inputs read ``None``: such checks return
*skip*) and every parallel fact (world size, degrees) from ``ctx.layout``. ``cache`` holds
what one check measured for another (parameter counts, image size, audio duration).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from wan_s2v_runner.shared.config import draft, format_validation_error
from wan_s2v_runner.shared.layout import Layout, Mode
from wan_s2v_runner.shared.spec import RunSpec

from .facts import MachineFacts


class ModeSource(str, Enum):
    """Where the checked mode came from."""

    FLAG = "flag"  # --mode / config
    SPEC = "spec"  # a complete run spec (run's gate)
    RECOMMENDED = "recommended"  # doctor picked it
    DEFAULT = "default"  # not given, not yet recommended


@dataclass
class CheckContext:
    facts: MachineFacts
    spec: RunSpec  # validated when ``complete``; else config.draft's lenient view
    complete: bool = True
    mode_source: ModeSource = ModeSource.SPEC
    missing: list[str] = field(default_factory=list)  # required inputs not given (doctor)
    spec_error: Optional[str] = None  # why the given values do not make a valid RunSpec
    notes: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)
    #: rank groups of this spec side by side on the node (``serve --replicas``): they share its host
    #: RAM, and group i holds the node's GPUs i*nproc .. (i+1)*nproc-1
    node_groups: int = 1
    #: the user set ``--dit-offload`` (flag, TOML or environment): ``--mode auto`` and the doctor
    #: keep their choice rather than turning streaming on
    dit_offload_given: bool = False
    #: the job runs on a rank group already up (a server's): what the group's start needed, its
    #: rendezvous port, is the group's own now, not something in the job's way
    group_running: bool = False
    #: a server's rank group (``serve``: its start and each job): a released T5 or wav2vec2 is built
    #: again beside the DiT for a new prompt or speech, so the plan counts them beside it
    served: bool = False

    # ----- derived: asked of the spec and its layout, never re-derived here -----
    @property
    def mode(self) -> Mode:
        return self.spec.mode

    @property
    def layout(self) -> Layout:
        return self.spec.layout

    def layout_for(self, mode: Mode) -> Layout:
        return Layout.for_mode(mode, self.spec.world_size, self.spec.cfg_parallel, self.spec.vae_parallel)

    @property
    def offload(self) -> bool:
        return self.spec.offload

    @property
    def on_cuda(self) -> bool:
        return self.spec.device == "cuda"

    @property
    def local_gpus(self) -> list[dict]:
        """The GPUs this node's ranks use (local rank i -> visible GPU i), every group's."""
        return self.facts.gpus[: self.spec.nproc * self.node_groups]

    def with_mode(self, mode: Mode, source: ModeSource) -> "CheckContext":
        self.spec = _updated(self.spec, mode=Mode(mode))
        self.mode_source = ModeSource(source)
        return self

    def with_settings(self, **update: Any) -> "CheckContext":
        """A copy with other settings (e.g. a smaller size to try), sharing nothing mutable."""
        return CheckContext(facts=self.facts, spec=_updated(self.spec, **update), complete=self.complete,
                            mode_source=self.mode_source, missing=list(self.missing),
                            spec_error=self.spec_error, notes=list(self.notes), cache=dict(self.cache),
                            node_groups=self.node_groups, dit_offload_given=self.dit_offload_given,
                            group_running=self.group_running, served=self.served)

    # ----- construction -----
    @classmethod
    def for_spec(cls, spec: RunSpec, facts: Optional[MachineFacts] = None) -> "CheckContext":
        if facts is None:
            from .probe import probe_machine
            facts = probe_machine()
        return cls(facts=facts, spec=spec)

    @classmethod
    def for_values(cls, values: dict, facts: Optional[MachineFacts] = None) -> "CheckContext":
        """Lenient: any subset of RunSpec fields (already merged: env < TOML < flags)."""
        if facts is None:
            from .probe import probe_machine
            facts = probe_machine()
        vals = {k: v for k, v in values.items() if v is not None}
        notes: list[str] = []
        mode_given = vals.get("mode") not in (None, "auto")
        if not mode_given:
            vals.pop("mode", None)
        if "device" not in vals:
            vals["device"] = "cuda" if facts.gpu_count else "cpu"
            notes.append(f"--device {vals['device']} assumed ({facts.gpu_count} CUDA GPUs visible)")
        if "nproc" not in vals:
            on_cuda = vals["device"] == "cuda"
            vals["nproc"] = max(1, facts.gpu_count) if on_cuda else 1
            notes.append(f"--nproc {vals['nproc']} assumed (all visible GPUs)" if on_cuda else "--nproc 1 assumed")
        lenient = draft(vals)
        return cls(facts=facts, spec=lenient.spec, complete=lenient.complete,
                   mode_source=ModeSource.FLAG if mode_given else ModeSource.DEFAULT,
                   missing=lenient.missing, notes=notes,
                   spec_error=format_validation_error(lenient.error) if lenient.error else None,
                   dit_offload_given="dit_offload" in vals)


def _updated(spec: RunSpec, **update: Any) -> RunSpec:
    """model_copy that keeps a draft a draft (no validation of the missing inputs)."""
    return spec.model_copy(update=update)
