"""The loop's own step control: one small message per denoising step (the clip steps) or per
block (the live pipeline) that says whether the job goes on, and why not.

A message (:class:`StepMessage`) holds:

* ``signal`` (:class:`Signal`): go on, or stop: the server cancelled the job or lost it to another
  holder (rank 0 reads its inbox: :attr:`~wan_s2v_runner.rank.job_contract.Hooks.stop_requested`, a
  local question), rank 0's video writer failed (a full disk), or, in the pipeline, the end of the
  job's blocks;
* ``fault``: the first DiT block whose output held inf or NaN on any rank (``--dtype fp16``'s guard,
  :class:`patches.fp16_compute.Guard`, read after the rank's DiT pass: the guard calls no
  collective), and the 0-based ``fault_step`` and ``fault_at`` (clip or block) where it happened;
* ``measure``: ``--cache``'s measure for the next step (the measuring rank's predicted change;
  negative: compute it; :mod:`~wan_s2v_runner.rank.step_cache`).

How it travels:

* **The clip steps** (:class:`Lockstep`): every rank is at the same step, so the message is agreed
  by one all-reduce (MAX) of five float64 values at each step's end, on the default group, where
  there is anything to agree on (a served job's stop, the cache's reuse, fp16's guard) and more
  than one rank. Every rank then takes the same decision from the same numbers: reuse the next
  step, stop here (cancelled, lost), or fail here with the fault. ``wan-s2v run`` and ``batch`` of
  a plain bf16/fp32 job run no such collective.
* **The pipelined blocks** (:mod:`~wan_s2v_runner.rank.block_pipeline`): the message is the header of
  the buffer that carries a block's latents from stage to stage (:func:`pack`, :data:`LINK_DTYPE`;
  the decoding rank's stop, and a FAILED from its video writer, start the stream's terminal message),
  so a stop or a fault travels with the data: a stage that faulted marks the block, the decoding
  rank learns it with the block and ends the job's stream, and every rank ends on the stream's
  last message, which says why.

Hooks and patches call no collective: what they know goes into the message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Callable, Optional

import torch
import torch.distributed as dist

from patches.fp16_compute import NonFiniteActivation
from wan_s2v_runner.rank.lease import JobLost

#: the dtype of the latents that travel between pipeline stages (the scheduler's: fp32), and of the
#: messages' buffers; every stage sends and receives this one
LINK_DTYPE = torch.float32
#: values a message's header holds: signal, fault key, fault step, fault unit, measure, then zeros:
#: 16, so that a link buffer's latents start 64 bytes in (a view the GPU's kernels see aligned)
HEADER = 16
#: the header's values that mean something
FIELDS = 5
#: the fault key of a non-finite output after the last block (the audio injection, the head)
OUTPUT_FAULT = 1 << 20


class JobCancelled(Exception):
    """The server cancelled the job in progress; raised on every rank at the same step or block."""


class WriteFailed(Exception):
    """The decoding rank could not write the job's video (a full disk, say): every rank ends the
    job at the same step or block; the decoding rank records the cause (its writer's error)."""


class Signal(IntEnum):
    """What a message says of the job (larger wins when ranks disagree: lost before cancelled,
    as a lost job's cancel is its server's way of saying so too)."""

    GO = 0
    END = 1  # the pipeline's last message: no block follows
    CANCELLED = 2
    LOST = 3
    FAILED = 4  # the decoding rank's writes failed: the job's own error


@dataclass(frozen=True)
class StepMessage:
    signal: Signal = Signal.GO
    #: the first non-finite DiT block (``None``: none; :data:`OUTPUT_FAULT`: the output)
    fault: Optional[int] = None
    fault_step: int = -1
    fault_at: int = -1
    measure: float = -1.0

    @property
    def stops(self) -> bool:
        return self.fault is not None or self.signal in (Signal.CANCELLED, Signal.LOST, Signal.FAILED)

    def vector(self) -> list[float]:
        """The values, so that an element-wise MAX of several ranks' messages keeps the largest
        signal, the lowest fault and the measuring rank's measure (the others say -1, no measure:
        below any measure, 0 or more)."""
        return [float(self.signal), -float(self.fault) if self.fault is not None else -math.inf,
                float(self.fault_step), float(self.fault_at), self.measure]

    @classmethod
    def of(cls, values) -> "StepMessage":
        signal, fault, step, at, measure = (float(v) for v in list(values)[:FIELDS])
        return cls(Signal(int(signal)), None if fault == -math.inf else int(-fault), int(step), int(at), measure)

    def with_fault(self, fault: Optional[int], step: int, at: int) -> "StepMessage":
        """This message, marked with a fault found at ``step`` of clip or block ``at`` (0-based; the
        first fault kept)."""
        if fault is None or self.fault is not None:
            return self
        return replace(self, fault=fault, fault_step=step, fault_at=at)

    def error(self, steps: int, unit: str) -> Optional[BaseException]:
        """What every rank raises for this message, or None: the fault first (the job's own error),
        then the server's word."""
        if self.fault is not None:
            block = None if self.fault >= OUTPUT_FAULT else self.fault
            return NonFiniteActivation(block).at(self.fault_step + 1, steps, self.fault_at + 1, unit)
        if self.signal is Signal.FAILED:
            return WriteFailed("the decoding rank could not write the job's video")
        if self.signal is Signal.LOST:
            return JobLost("the job's server lost it to another holder")
        if self.signal is Signal.CANCELLED:
            return JobCancelled("the job")
        return None


def guard_fault(guard) -> Optional[int]:
    """The first non-finite block the rank's guard saw since it was last asked (``None``: none or
    no guard), as a fault key."""
    if guard is None:
        return None
    first = guard.take()
    if first is None:
        return None
    return OUTPUT_FAULT if first >= guard.blocks else first


class Lockstep:
    """The clip steps' control: every rank at the same step agrees one message per step.

    ``stop_requested()``: the server's word on this rank (rank 0's inbox; None elsewhere);
    ``guard``: fp16's guard of this rank's DiT, or None; ``reuses``: ``--cache`` can reuse steps."""

    def __init__(self, device: torch.device, stop_requested: Optional[Callable[[], Optional[Signal]]],
                 guard, reuses: bool):
        self.device = device
        self.stop_requested, self.guard = stop_requested, guard
        world = dist.get_world_size() if dist.is_initialized() else 1
        #: one collective a step only where there is something to agree on among several ranks
        self.collective = world > 1 and (stop_requested is not None or guard is not None or reuses)

    def after_step(self, step: int, at: int, measure: float) -> StepMessage:
        """This rank's message at the end of ``step`` (0-based) of clip ``at``, agreed with every rank's."""
        signal = (self.stop_requested() if self.stop_requested is not None else None) or Signal.GO
        mine = StepMessage(signal, measure=measure).with_fault(guard_fault(self.guard), step, at)
        if not self.collective:
            return mine
        # nccl reduces CUDA tensors only; gloo, CPU ones
        buf = torch.tensor(mine.vector(), dtype=torch.float64,
                           device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return StepMessage.of(buf.tolist())


# --------------------------------------------------------------------------- the pipeline's buffers
def pack(message: StepMessage, latents: Optional[torch.Tensor], numel: int, device: torch.device) -> torch.Tensor:
    """One buffer for a link: the message's header, then ``latents`` flattened (``None``: a message
    without latents, e.g. the stream's end: zeros of ``numel``)."""
    buf = torch.zeros(HEADER + numel, dtype=LINK_DTYPE, device=device)
    buf[:FIELDS] = torch.tensor(message.vector(), dtype=LINK_DTYPE)
    if latents is not None:
        buf[HEADER:] = latents.reshape(-1).to(LINK_DTYPE)
    return buf


def unpack(buf: torch.Tensor, shape) -> tuple[StepMessage, torch.Tensor]:
    """A link's buffer as (its message, its latents of ``shape``)."""
    return StepMessage.of(buf[:FIELDS].tolist()), buf[HEADER:].view(shape)


def empty(numel: int, device: torch.device) -> torch.Tensor:
    """A buffer to receive a link's message of ``numel`` latent values into."""
    return torch.empty(HEADER + numel, dtype=LINK_DTYPE, device=device)
