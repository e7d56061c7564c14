"""Where a rank group's jobs come from (:class:`JobSource`): the launcher chooses it when it makes
the run directory and records it in the run's ``spec.json`` (key :data:`SPEC_KEY`, beside the
spec's fields); every rank reads it there and takes its jobs from that source alone
(:mod:`wan_s2v_runner.rank.job_sources`), instead of guessing from which files the directory holds.

A ``spec.json`` written before the key existed has its source read the old way: an ``inbox/``
folder is a server's, a ``jobs.jsonl`` or a group's spec (no job in it) a batch's, else the run's
own job.
"""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from wan_s2v_runner.shared import atomic, inbox
from wan_s2v_runner.shared.jobs import JOBS_FILE
from wan_s2v_runner.shared.spec import SPEC_KEY, GroupSpec, JobSpec

__all__ = ["SPEC_KEY", "JobSource", "write_spec", "read_source", "source_of"]


class JobSource(str, Enum):
    """Where a rank group's jobs come from."""

    RUN = "run"  # the run's own one job: spec.json is a run's spec (wan-s2v run, resume)
    LIST = "list"  # the launcher's jobs.jsonl, in order (wan-s2v batch)
    INBOX = "inbox"  # each job a server posts to the run directory's inbox/ until it says stop (wan-s2v serve)


def write_spec(run_dir: Path, spec: GroupSpec, source: JobSource) -> None:
    """``run_dir/spec.json``: the group's spec (a run's: with its one job) and where its jobs come from."""
    data = json.loads(spec.to_json())
    data[SPEC_KEY] = source.value
    atomic.write_text(Path(run_dir) / "spec.json", json.dumps(data, indent=2))


def read_source(run_dir: Path) -> JobSource:
    """The job source ``run_dir/spec.json`` records (an older one's: read from the files, as then)."""
    return source_of(json.loads((Path(run_dir) / "spec.json").read_text(encoding="utf-8")), run_dir)


def source_of(data: dict, run_dir: Path) -> JobSource:
    """The job source of ``data``, ``run_dir``'s spec.json as read (:func:`read_source`)."""
    if SPEC_KEY in data:
        return JobSource(data[SPEC_KEY])
    if inbox.inbox_of(run_dir).is_dir():
        return JobSource.INBOX
    if (Path(run_dir) / JOBS_FILE).is_file() or not any(k in data for k in JobSpec.model_fields):
        return JobSource.LIST  # a group's spec without an inbox: a batch's
    return JobSource.RUN
