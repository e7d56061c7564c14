"""The run spec: one validated description of a run, shared by the launcher and every rank.

Like torchtitan's ``ParallelDims``, a :class:`RunSpec` validates itself on construction and
everything else asks it (``spec.world_size``, ``spec.layout``). The launcher builds it once
(TOML file, then CLI flags on top), resolves ``seed=-1`` to a concrete seed, writes it to the run
directory as JSON, and each rank reads that file back. Nothing else carries run settings.
"""
from __future__ import annotations

import random
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Optional

import tomllib
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Upstream S2V default area (width*height); the engine fits the reference image inside it.
DEFAULT_MAX_AREA = 1024 * 704
MAX_SEED = 2**63 - 1


class Mode(str, Enum):
    """Parallel modes. Each has a runner module in ``runners/``."""

    ULYSSES = "ulysses"
    FSDP_FIXED = "fsdp-fixed"
    HYBRID = "hybrid"


class Layout(BaseModel):
    """What a mode means for the engine: derived from the spec, never set by hand."""

    model_config = ConfigDict(frozen=True)

    world_size: int
    use_sp: bool  # Ulysses sequence parallel over all ranks
    dit_fsdp: bool
    t5_fsdp: bool
    t5_cpu: bool

    @property
    def ulysses_degree(self) -> int:
        return self.world_size if self.use_sp else 1


def parse_size(value: str) -> int:
    """'1024*704' or '1024x704' -> area in pixels."""
    for sep in ("*", "x", "X"):
        if sep in value:
            w, h = value.split(sep, 1)
            try:
                w_i, h_i = int(w), int(h)
            except ValueError:
                break
            if w_i > 0 and h_i > 0:
                return w_i * h_i
    raise ValueError(f"size must look like WIDTH*HEIGHT (e.g. 1024*704), got {value!r}")


class RunSpec(BaseModel):
    """Everything one run needs. Paths are absolute after validation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # engine & inputs
    wan_repo: Optional[Path] = Field(None, description="Wan2.2 checkout (repo root); None = installed `wan` package")
    ckpt_dir: Path
    image: Path
    audio: Path
    prompt: str = Field(min_length=1)
    negative_prompt: str = ""  # "" = the engine's default negative prompt
    # sampling
    max_area: int = Field(DEFAULT_MAX_AREA, gt=0)
    infer_frames: int = Field(80, gt=0)
    num_clips: Optional[int] = Field(None, gt=0, description="None = as many as the audio needs")
    steps: int = Field(40, gt=0)
    shift: float = Field(3.0, gt=0)
    guide_scale: float = Field(4.5, ge=0)
    solver: Literal["unipc", "dpm++"] = "unipc"
    seed: int = Field(-1, ge=-1, le=MAX_SEED)
    start_from_ref: bool = False
    offload_model: Optional[bool] = None  # None = upstream rule: offload only with one rank
    # parallel layout
    mode: Mode = Mode.ULYSSES
    nproc: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = Field(None, ge=1, le=65535, description="None: a free port (one node) or 29500")
    device: Literal["cuda", "cpu"] = "cuda"
    attention: Literal["auto", "fa3", "fa2", "sdpa"] = "auto"
    threads: int = Field(1, ge=1, description="torch threads per rank on CPU")
    pg_timeout_s: float = Field(3600.0, gt=0, description="process-group collective timeout")
    # supervision: no progress on any rank for this long -> stacks dumped, run stopped (0 = off)
    watchdog_load_s: float = Field(1800.0, ge=0, description="limit while importing/loading/sharding")
    watchdog_step_s: float = Field(600.0, ge=0, description="limit per step, encode, decode, save")
    # outputs
    output: Path
    frames_out: Optional[Path] = Field(None, description="also save the raw frames tensor (.pt), for parity checks")
    runs_root: Path = Path("runs")

    @field_validator("wan_repo", "ckpt_dir", "image", "audio", "output", "frames_out", "runs_root")
    @classmethod
    def _absolute(cls, v: Optional[Path]) -> Optional[Path]:
        return None if v is None else Path(v).expanduser().absolute()

    @model_validator(mode="after")
    def _consistent(self) -> "RunSpec":
        if self.infer_frames % 4:
            raise ValueError(f"infer_frames must be a multiple of 4 (got {self.infer_frames})")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.device == "cpu" and self.attention in ("fa2", "fa3"):
            raise ValueError(f"--attention {self.attention} needs CUDA; use --attention sdpa (or auto) with --device cpu")
        limits = [x for x in (self.watchdog_load_s, self.watchdog_step_s) if x > 0]
        if limits and self.pg_timeout_s <= max(limits):
            raise ValueError(f"pg_timeout_s ({self.pg_timeout_s:g}) must exceed the watchdog limits "
                             f"({max(limits):g}) so the watchdog reports a hang before the collective times out")
        if self.output.suffix.lower() != ".mp4":
            raise ValueError(f"output must be an .mp4 file, got {self.output.name!r}")
        return self

    # ----- derived facts everything else asks -----
    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def layout(self) -> Layout:
        ws = self.world_size
        if self.mode is Mode.ULYSSES:
            return Layout(world_size=ws, use_sp=ws > 1, dit_fsdp=False, t5_fsdp=False, t5_cpu=False)
        if self.mode is Mode.FSDP_FIXED:
            return Layout(world_size=ws, use_sp=False, dit_fsdp=True, t5_fsdp=True, t5_cpu=False)
        return Layout(world_size=ws, use_sp=ws > 1, dit_fsdp=True, t5_fsdp=False, t5_cpu=True)

    @property
    def offload(self) -> bool:
        if self.device == "cpu":
            return False  # nothing to offload to; the engine's offload path calls torch.cuda.synchronize
        return self.offload_model if self.offload_model is not None else self.world_size == 1

    def with_resolved_seed(self, rng: Optional[random.Random] = None) -> "RunSpec":
        """seed -1 means random: chosen once here (launcher), recorded in the spec every rank reads."""
        if self.seed >= 0:
            return self
        return self.model_copy(update={"seed": (rng or random.SystemRandom()).randint(0, MAX_SEED)})

    # ----- serialization -----
    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json_file(cls, path: Path) -> "RunSpec":
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


def load_toml(path: Path) -> dict[str, Any]:
    """Read a run.toml. Keys are spec field names; '-' may be used for '_'."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get("run", data)
    return {k.replace("-", "_"): v for k, v in table.items()}


def build_spec(file_values: dict[str, Any], cli_values: dict[str, Any]) -> RunSpec:
    """TOML values first, CLI flags (those actually given, i.e. not None) on top."""
    merged = dict(file_values)
    merged.update({k: v for k, v in cli_values.items() if v is not None})
    return RunSpec(**merged)
