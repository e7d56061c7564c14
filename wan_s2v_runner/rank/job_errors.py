"""A served job's Python error: the job's, when the rank group is still in step; the group's
otherwise (issue #59's first mend).

Before, any exception in a served job's work ended the rank (and so the group): the server
restarted the group, which read the DiT again, up to the job's attempts, while every queued job
waited. Now, in a served group, a rank whose job raised asks its peers where they are, on a
control group of its own (gloo, with a bounded wait: :data:`CONTROL_TIMEOUT_S`), never on the
groups the job's collectives use:

* every rank raised, at the same point (stage, clip and step): no rank is left inside a
  collective, so the group is in step; the job fails with its error (``job_failed``, the server
  records it) and the group takes the next job, its weights loaded;
* an error that is the group's whatever the peers did (:func:`the_groups`: a collective's failure,
  a sticky device error, an interrupt) ends the rank at once, as before;
* a peer does not answer within the bound (it is inside one of the job's collectives, waiting for
  the rank that raised) or raised elsewhere: the error is the group's, as before (the rank ends,
  the server restarts the group).

One rank is always in step. ``wan-s2v run`` and ``batch`` keep ending on an error: a run has no
next job, and a batch's failed job is resumed from its clips.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

#: how long a rank whose job raised waits for every peer to say where it raised
CONTROL_TIMEOUT_S = 30


def the_groups(e: BaseException) -> bool:
    """An error that is the group's whatever the other ranks did: not an ``Exception`` (an
    interrupt, an exit), a collective's own failure (``torch.distributed.DistError``: a peer gone,
    a timeout), or a device error that stays with the process (``torch.AcceleratorError``: CUDA's
    sticky errors; a CUDA out-of-memory error is not one: the next job can run)."""
    import torch

    if not isinstance(e, Exception) or isinstance(e, dist.DistError):
        return True
    sticky = getattr(torch, "AcceleratorError", None)
    return (sticky is not None and isinstance(e, sticky)) or "CUDA error" in str(e)


def control_group(timeout_s: float = CONTROL_TIMEOUT_S):
    """The group's control channel (every rank calls it, at the same point), or None alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def in_step(point: tuple, group) -> bool:
    """Whether every rank of the group raised at ``point`` (each rank that raised calls this with
    where it was). True alone; False when a peer raised elsewhere or does not answer in time."""
    if group is None:
        return True
    points: list[Optional[tuple]] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(points, point, group=group)
    except Exception:  # noqa: BLE001 - a peer that never answers: it is inside one of the job's collectives
        return False
    return all(tuple(p) == tuple(point) for p in points)
