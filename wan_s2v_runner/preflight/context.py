"""What checks read: :class:`CheckContext`, a lenient view of a run plus the machine's facts.

``run`` builds it from a validated :class:`~wan_s2v_runner.spec.RunSpec` (:meth:`from_spec`).
``doctor`` may have no checkpoint, inputs or prompt, so :meth:`from_values` takes the partial
values (config file + env + flags), fills the rest with RunSpec's defaults, and records each
assumption in ``notes`` (e.g. ``--nproc`` defaults to the number of visible GPUs, ``--mode`` to
the recommendation). Checks needing a missing value return *skip*. ``cache`` holds what one
check measured for another (checkpoint parameter counts, image size, audio duration).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.spec import DEFAULT_MAX_AREA, Layout, Mode, RunSpec

from .probe import MachineFacts


@dataclass
class CheckContext:
    facts: MachineFacts
    spec: Optional[RunSpec] = None  # set when the run spec is complete and valid
    mode: Mode = Mode.ULYSSES
    mode_source: str = "default"  # "flag" | "spec" | "recommended" | "default"
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    device: str = "cuda"
    attention: str = "auto"
    wan_repo: Optional[Path] = None
    ckpt_dir: Optional[Path] = None
    image: Optional[Path] = None
    audio: Optional[Path] = None
    prompt: Optional[str] = None
    output: Optional[Path] = None
    frames_out: Optional[Path] = None
    runs_root: Optional[Path] = None
    max_area: int = DEFAULT_MAX_AREA
    infer_frames: int = 80
    num_clips: Optional[int] = None
    start_from_ref: bool = False
    offload_model: Optional[bool] = None
    spec_error: Optional[str] = None  # why the given values do not make a valid RunSpec
    notes: list[str] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)

    # ----- derived, same rules as RunSpec -----
    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def _shadow(self, mode: Optional[Mode] = None) -> RunSpec:
        return RunSpec.model_construct(mode=mode or self.mode, nproc=self.nproc, nnodes=self.nnodes,
                                       device=self.device, offload_model=self.offload_model)

    def layout_for(self, mode: Mode) -> Layout:
        return self._shadow(mode).layout

    @property
    def layout(self) -> Layout:
        return self.layout_for(self.mode)

    @property
    def offload(self) -> bool:
        return self._shadow().offload

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def local_gpus(self) -> list[dict]:
        """The GPUs this node's ranks use (local rank i -> visible GPU i)."""
        return self.facts.gpus[: self.nproc]

    def with_mode(self, mode: Mode, source: str) -> "CheckContext":
        self.mode, self.mode_source = Mode(mode), source
        return self

    # ----- construction -----
    @classmethod
    def from_spec(cls, spec: RunSpec, facts: Optional[MachineFacts] = None) -> "CheckContext":
        if facts is None:
            from .probe import probe_machine
            facts = probe_machine()
        fields = {k: getattr(spec, k) for k in (
            "mode", "nproc", "nnodes", "node_rank", "master_addr", "master_port", "device",
            "attention", "wan_repo", "ckpt_dir", "image", "audio", "prompt", "output", "frames_out",
            "runs_root", "max_area", "infer_frames", "num_clips", "start_from_ref", "offload_model")}
        return cls(facts=facts, spec=spec, mode_source="spec", **fields)

    @classmethod
    def from_values(cls, file_values: dict, cli_values: dict,
                    facts: Optional[MachineFacts] = None) -> "CheckContext":
        """Lenient: any subset of RunSpec fields (TOML/env values, then flags that are not None)."""
        if facts is None:
            from .probe import probe_machine
            facts = probe_machine()
        merged = dict(file_values)
        merged.update({k: v for k, v in cli_values.items() if v is not None})
        notes: list[str] = []
        mode_given = merged.get("mode") not in (None, "auto")
        defaults = {k: f.default for k, f in RunSpec.model_fields.items() if not f.is_required()}
        vals = {**defaults, **merged}
        if "device" not in merged:
            vals["device"] = "cuda" if facts.gpu_count else "cpu"
            notes.append(f"--device {vals['device']} assumed ({facts.gpu_count} CUDA GPUs visible)")
        if "nproc" not in merged:
            vals["nproc"] = max(1, facts.gpu_count) if vals["device"] == "cuda" else 1
            notes.append(f"--nproc {vals['nproc']} assumed (all visible GPUs)" if vals["device"] == "cuda"
                         else "--nproc 1 assumed")
        if vals.get("output") is None:
            vals["output"] = Path("outputs/s2v.mp4")

        def path(v):
            return None if v is None else Path(v).expanduser().absolute()

        ctx = cls(
            facts=facts,
            mode=Mode(vals["mode"]) if mode_given else Mode.ULYSSES,
            mode_source="flag" if mode_given else "default",
            nproc=int(vals["nproc"]), nnodes=int(vals.get("nnodes") or 1),
            node_rank=int(vals.get("node_rank") or 0), master_addr=str(vals.get("master_addr") or "127.0.0.1"),
            master_port=vals.get("master_port"), device=vals["device"], attention=vals.get("attention") or "auto",
            wan_repo=path(vals.get("wan_repo")), ckpt_dir=path(vals.get("ckpt_dir")), image=path(vals.get("image")),
            audio=path(vals.get("audio")), prompt=vals.get("prompt"), output=path(vals.get("output")),
            frames_out=path(vals.get("frames_out")), runs_root=path(vals.get("runs_root") or "runs"),
            max_area=int(vals.get("max_area") or DEFAULT_MAX_AREA), infer_frames=int(vals.get("infer_frames") or 80),
            num_clips=vals.get("num_clips"), start_from_ref=bool(vals.get("start_from_ref")),
            offload_model=vals.get("offload_model"), notes=notes)
        # a complete, valid spec when possible; else remember why not (reported by inputs.flags)
        probe_vals = {**merged, "device": ctx.device, "nproc": ctx.nproc, "output": ctx.output}
        if not mode_given:
            probe_vals.pop("mode", None)
        missing = [k for k in ("ckpt_dir", "image", "audio", "prompt") if probe_vals.get(k) in (None, "")]
        placeholder = {"ckpt_dir": Path("/nonexistent"), "image": Path("/nonexistent.png"),
                       "audio": Path("/nonexistent.wav"), "prompt": "placeholder"}
        try:
            spec = RunSpec(**{**{k: placeholder[k] for k in missing}, **probe_vals})
            if not missing:
                ctx.spec = spec
        except Exception as e:  # pydantic ValidationError
            from wan_s2v_runner.cli import format_validation_error
            try:
                ctx.spec_error = format_validation_error(e)
            except Exception:  # noqa: BLE001
                ctx.spec_error = str(e)
        ctx.cache["missing"] = missing
        return ctx
