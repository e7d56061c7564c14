"""The rules every job store follows, in one place (the drivers hold only their SQL): a page's
size, the order jobs are claimed in, what a failed rank group means for its job, how counts and
places read, what a store can hold, how a lease is told apart from another server's, and what a
fleet's first marker looks like. A driver asks these; the contract suite checks both drivers
obey them."""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from wan_s2v_runner.serve.store.protocol import JobStatus, NotStorable

#: a job that took its rank group down this many times is failed, not retried again
MAX_FAILURES = 2
#: a job claimed this many times without an end (its servers died under it: a host OOM, say) is failed
MAX_ATTEMPTS = 5
#: the most videos one page of ``GET /v1/videos`` holds (OpenAI's list: 20 by default, 100 at most)
PAGE_MAX = 100
#: the claim order (SQL): jobs put back after an interruption first (they have a start), then by submission
CLAIM_ORDER = "started_at IS NULL, seq"
TERMINAL = tuple(s.value for s in JobStatus if s.terminal)


def attempts_exhausted(attempt: int) -> Optional[str]:
    """Why a job claimed for the ``attempt``-th time is failed instead of run (None: it runs)."""
    if attempt <= MAX_ATTEMPTS:
        return None
    return (f"the job was taken {attempt - 1} times without an end (its servers stopped under it each time). Fix: "
            "look at what the servers ran out of (memory, disk) and submit it again")


def page_size(limit: Any) -> int:
    return max(1, min(int(limit), PAGE_MAX))


def counts_of(rows: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Jobs by status, every status present (0 where none)."""
    return {s.value: 0 for s in JobStatus} | dict(rows)


def after_group_failure(failures: int, error: str) -> tuple[JobStatus, Optional[str]]:
    """A job's rank group failed under it for the ``failures``-th time: back to the queue (its
    clip checkpoints kept), or failed for good at :data:`MAX_FAILURES`, with the error it gets."""
    if failures >= MAX_FAILURES:
        return JobStatus.FAILED, f"the rank group failed {failures} times on this job; last: {error}"
    return JobStatus.QUEUED, None


def unstorable(text: str) -> Optional[str]:
    """Why no store may keep ``text`` (None: every one may): a NUL character (PostgreSQL's text
    and JSONB refuse it; SQLite would keep it, so both refuse), or a lone surrogate (not UTF-8)."""
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    return None


def storable_text(text: Optional[str]) -> Optional[str]:
    """``text`` as every store keeps it (what would be refused replaced): for what the server
    writes itself, an error message from anywhere."""
    if text is None:
        return None
    return text.replace("\x00", "\\0").encode("utf-8", "replace").decode("utf-8")


def check_storable(value: Any, where: str = "the job") -> None:
    """:class:`NotStorable` when ``value`` (JSON data) holds a string no store may keep
    (:func:`unstorable`)."""
    if isinstance(value, str):
        why = unstorable(value)
        if why:
            raise NotStorable(f"{where}: {why}")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_storable(k, where)
            check_storable(v, f"{k}" if where == "the job" else where)
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_storable(v, where)


def same_request(stored_hash: Optional[str], request_hash: Optional[str]) -> bool:
    """An ``Idempotency-Key`` sent again names the same job when its request is the same (or the
    request's hash was not kept)."""
    return stored_hash is None or request_hash is None or stored_hash == request_hash


def holder_of(owner: str, index: int) -> str:
    """The name keeper ``index`` of server ``owner`` holds leases under (``OWNER#index``): two
    groups of one server never both hold a job, and the server takes all of them back at start."""
    return f"{owner}#{index}"


def fleet_marker(fleet_id: str, queue: str) -> str:
    """The shared directory's marker (``.wan-s2v-fleet.json``): the fleet and its queue."""
    return json.dumps({"fleet": fleet_id, "queue": queue}, indent=1) + "\n"
