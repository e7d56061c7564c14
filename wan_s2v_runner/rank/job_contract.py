"""What a job's shell (:mod:`~wan_s2v_runner.rank.job_shell`) and its step drivers
(:mod:`~wan_s2v_runner.rank.clip_steps`, :mod:`~wan_s2v_runner.rank.block_pipeline`) share: the
request, the hooks a job reports through, the inputs the shell hands a driver, what a driver
provides (:class:`StepDriver`), where the frames go (:class:`FrameSink`), and the broadcast the
encode choreography and the clip steps use."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist

from wan_s2v_runner.rank.step_control import Signal
from wan_s2v_runner.shared.events import ProgressUnit
from wan_s2v_runner.shared.speech_windows import SpeechWindow


@dataclass
class Request:
    """The generate() arguments our runner uses (names as upstream's)."""

    prompt: str
    ref_image_path: str
    audio_path: str
    num_repeat: Optional[int]
    max_area: int
    infer_frames: int
    shift: float
    sample_solver: str
    sampling_steps: int
    guide_scale: float
    n_prompt: str
    seed: int
    offload_model: bool
    init_first_frame: bool
    pose_video: Optional[str] = None
    cache: str = "off"  # --cache (wan_s2v_runner.shared.cache_policy); not upstream's: ours to skip DiT passes
    #: the live recipe: seconds of speech past a block its features read (shared.speech_windows)
    speech_lookahead: float = SpeechWindow.lookahead_s


@dataclass
class Reference:
    """A driver's reference encode: ``latents`` every DiT rank needs (broadcast where one rank made
    them), small integer ``flags`` that travel with the size, and ``local`` values kept on the
    ranks that made them (the clip steps' initial last frames)."""

    latents: dict[str, torch.Tensor]
    flags: dict[str, int] = field(default_factory=dict)
    local: dict = field(default_factory=dict)


@dataclass
class Inputs:
    """What every rank holds after the encode."""

    height: int
    width: int
    #: the speech's bucket count: clips (before ``num_repeat``'s cap) or blocks (0: a live session's,
    #: known when its speech ends)
    units: int
    #: [1, layers, C, frames], param dtype, on device; the live recipe's: no frames (its blocks make
    #: their features as they start), the shape saying the features' size
    audio_emb: torch.Tensor
    contexts: list  # per text of the driver's, its T5 context (a list of tensors [L, 4096]) on device
    latents: dict[str, torch.Tensor]
    flags: dict[str, int]
    local: dict


@dataclass(frozen=True)
class SpeechSpan:
    """A live block's share of its job's speech, handed to the sink with its frames."""

    #: the block's 0.75 s of the speech's timeline (float32 at 16 kHz): what its frames play with
    samples: object
    #: when the last sample the block needed arrived (a live session's; None: a file's): where the
    #: block's latency is counted from
    ready_at: Optional[float] = None
    #: a session's: where the pushed speech in the span came from
    #: (:class:`~wan_s2v_runner.shared.speech_timeline.Run`, timeline samples), written before its
    #: fragment (:func:`~wan_s2v_runner.shared.fmp4.speech_runs_box`) for the session's clients;
    #: None: a file's
    runs: Optional[tuple] = None


class FrameSink(Protocol):
    """Where the decoding rank's frames go (:class:`~wan_s2v_runner.rank.video_writer.VideoWriter`
    in a run; :class:`FramesInMemory` for a caller that wants the frames)."""

    def frames(self, index: int, frames: torch.Tensor, count: Optional[int],
               speech: Optional[SpeechSpan] = None) -> None:
        """Unit ``index`` (0-based clip or block) of ``count`` (None: not known yet, a live session's)
        is decoded: its frames (1, 3, n, H, W) on the CPU (the sink may work on them while the loop
        goes on); ``speech``: the live recipe's, the block's span of the job's speech; None: the
        sink reads the job's speech file."""

    def clip_done(self, state, count: int) -> None:
        """The clip steps' state after a clip (the next clip's motion latents): a checkpoint."""


class FramesInMemory:
    """The sink :meth:`JobShell.generate` uses when given none: every unit's frames kept and
    returned whole, as upstream's ``generate`` returns them (memory grows with the video: for
    callers that want the tensor, not for long videos)."""

    def __init__(self):
        self.clips: list[torch.Tensor] = []

    def frames(self, index: int, frames: torch.Tensor, count: Optional[int], speech=None) -> None:
        self.clips.append(frames)

    def clip_done(self, state, count: int) -> None:
        pass

    def video(self) -> torch.Tensor:
        return torch.cat(self.clips, dim=2)[0]


@dataclass
class Hooks:
    """How the job reports, and what it asks of its source. Hooks call no collective."""

    stage: Callable[..., None] = lambda *a, **k: None
    #: a step (clip steps) or a block (pipeline) done on this rank: its progress record's fields
    step: Callable[..., None] = lambda **k: None
    #: decoding rank only: the frames and checkpoints (None: :meth:`JobShell.generate` keeps them in
    #: memory and returns them)
    sink: Optional[FrameSink] = None
    #: every rank, with --cache: a clip's steps computed and reused (:meth:`StepCache.record`), at its end
    cache_done: Optional[Callable[[dict], None]] = None
    #: the job's source's word on this rank, asked at each step or block: None (go on) or how the job
    #: stops (rank 0 of a served group reads its inbox; a local read, never a collective)
    stop_requested: Optional[Callable[[], Optional[Signal]]] = None
    #: the decoding rank, live recipe: the job's live figures after each decoded block
    live: Optional[Callable[[dict], None]] = None
    #: the decoding rank, live recipe: a live session's speech events
    #: (:class:`~wan_s2v_runner.rank.speech_source.SessionEvents`); None: the request's speech file
    speech_events: Optional[object] = None


class StepDriver(Protocol):
    """The denoising of one recipe, inside the shell."""

    unit: ProgressUnit
    #: whether the shell encodes the speech with the inputs (the clip recipe: upstream's pass over the
    #: file); False: the driver opens it (:meth:`open_speech`) and its blocks make their features
    encodes_speech: bool

    def open_speech(self, req: Request) -> tuple[torch.Tensor, int]:
        """(encodes_speech False, the encoding rank) the job's speech opened: a tensor the shell
        broadcasts as ``audio_emb`` and the job's units (0: not known yet)."""

    def texts(self, req: Request) -> tuple[str, ...]:
        """The texts T5 encodes for the job, in the order the driver reads their contexts."""

    def speech_frames(self, req: Request) -> int:
        """Video frames a unit of the speech covers (upstream's bucketing)."""

    def reference(self, req: Request, size: tuple[int, int], split: bool) -> Reference:
        """The reference's encode (``split``: this rank's rows of it, every rank taking part)."""

    def run(self, req: Request, inputs: Inputs, sink: Optional[FrameSink], resuming: bool, resume) -> None:
        """The denoising of the job (and its decode, on the decoding rank)."""

    def record(self) -> dict:
        """What the job's record says of the driver's work (``step_cache``, ``live``)."""


# --------------------------------------------------------------------------- broadcast helpers
def broadcast_tensors(tensors: dict, src: int, device: torch.device, group=None) -> dict:
    """Broadcast a dict of tensors (or lists of tensors) from ``src``: shapes/dtypes first as an
    object, then each tensor on ``device`` (nccl needs CUDA tensors). Bits are preserved."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensors
    me = dist.get_rank()
    meta = [None]
    if me == src:
        meta = [{k: ([(tuple(t.shape), t.dtype, t.device.type) for t in v] if isinstance(v, list)
                     else (tuple(v.shape), v.dtype, v.device.type)) for k, v in tensors.items()}]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = {}
    for k, m in meta[0].items():
        items = m if isinstance(m, list) else [m]
        srcs = (tensors[k] if isinstance(m, list) else [tensors[k]]) if me == src else [None] * len(items)
        got = []
        for (shape, dtype, _dev_type), t in zip(items, srcs):
            buf = t.to(device).contiguous() if me == src else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buf, src=src, group=group)
            got.append(buf if me != src else t)
        out[k] = got if isinstance(m, list) else got[0]
    return out
