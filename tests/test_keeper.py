"""The keeper's bookkeeping on a real SQLite store, its rank group played by the test (rank 0's
events handed to it as its group's news hands them; the group's door a real inbox folder): an end the store
could not take is owed and recorded once it answers, with the record rank 0 wrote at the time
(even when that file has gone meanwhile); an end whose files cannot be published fails the job
with the cause and leaves the keeper taking the next; one event's trouble costs no other; a job
taken too often is failed instead of run again.
"""
from __future__ import annotations

import json
import sqlite3
import time

import pytest

from wan_s2v_runner.serve.group import InboxDoor
from wan_s2v_runner.serve.store.protocol import JobStatus
from wan_s2v_runner.shared import inbox, media


@pytest.fixture
def kept(tmp_path, tiny_assets):
    """A keeper over a SQLite store, its group started (an inbox) and idle."""
    from wan_s2v_runner.serve.dirs import ServerDirs
    from wan_s2v_runner.serve.keeper import Keeper
    from wan_s2v_runner.serve.store.sqlite import SqliteJobStore
    from wan_s2v_runner.shared.spec import GroupSpec

    dirs = ServerDirs(tmp_path / "server")
    store = SqliteJobStore(dirs.queue, busy_timeout_s=0.1)  # a write waits 0.1 s for another's lock
    keeper = Keeper(GroupSpec(ckpt_dir=tiny_assets.ckpt_dir, device="cpu"), store, dirs)
    run_dir = tmp_path / "run"
    inbox.inbox_of(run_dir).mkdir(parents=True)
    keeper.group = InboxDoor(run_dir)  # the test plays the ranks: the group's door is its inbox
    keeper.group_started(run_dir)
    keeper.spec = {"image": str(tiny_assets.image), "audio": str(tiny_assets.audio), "prompt": "kept", "seed": 3,
                   "output": str(dirs.videos / "x.mp4")}
    yield keeper
    store.close()


def _idle(keeper) -> None:
    keeper.on_events([{"rank": 0, "kind": "stage", "stage": "idle", "t": time.time()}])


def _posted(keeper) -> dict:
    """The job the keeper handed its ranks (the newest in the inbox)."""
    return json.loads(sorted(inbox.inbox_of(keeper.run_dir).glob("job-*.json"))[-1].read_text())


def _made(keeper, job: dict, tiny_assets) -> None:
    """What rank 0 writes for a finished job: its mp4 and record in the attempt's folder."""
    from pathlib import Path

    mp4, record = Path(job["spec"]["output"]), Path(job["record"])
    mp4.write_bytes(tiny_assets.audio.read_bytes())  # bytes enough: the keeper moves them, never reads them
    record.write_text(json.dumps({"id": job["id"], "status": "ok", "output": {"path": str(mp4),
                                                                             "sha256": media.sha256_file(mp4)}}))


def _lock(keeper):
    """The queue file's write lock held by another connection (past the store's 0.1 s wait)."""
    other = sqlite3.connect(str(keeper.queue.path), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


def test_an_end_the_store_could_not_take_is_recorded_once_it_answers(kept, tiny_assets):
    kept.queue.job_insert("v1", kept.spec, 10)
    _idle(kept)
    job = _posted(kept)
    assert job["id"] == "v1" and kept.current == "v1"
    _made(kept, job, tiny_assets)
    other = _lock(kept)
    try:
        kept.on_events([{"rank": 0, "kind": "job_done", "id": "v1", "t": time.time()}])
        assert [o.what for o in kept.held.owed] == ["job v1: completed"] and kept.current is None
        _idle(kept)  # idle, but nothing is claimed while an end is owed
        assert len(list(inbox.inbox_of(kept.run_dir).glob("job-*.json"))) == 1
    finally:
        other.execute("ROLLBACK")
        other.close()
    (kept.dirs.attempt("v1", 1) / "v1.json").unlink()  # gone meanwhile: the record read at the end is kept
    kept._beat_at = 0
    kept.beat()
    row = kept.queue.job_get("v1")
    assert row.status is JobStatus.COMPLETED and row.record["status"] == "ok" and not kept.held.owed, row
    assert (kept.dirs.video("v1")).is_file() and json.loads(kept.dirs.record("v1").read_text())["attempt"] == 1
    assert not kept.dirs.work("v1").exists()  # nothing left to resume from


def test_an_end_whose_files_cannot_be_published_fails_the_job_and_the_keeper_goes_on(kept, tiny_assets):
    kept.queue.job_insert("v1", kept.spec, 10)
    kept.queue.job_insert("v2", kept.spec, 10)
    _idle(kept)
    job = _posted(kept)
    _made(kept, job, tiny_assets)
    kept.dirs.video("v1").mkdir(parents=True)  # where the mp4 goes, a directory: the move fails (an OSError)
    kept.on_events([{"rank": 0, "kind": "job_done", "id": "v1", "t": time.time()},
                    {"rank": 0, "kind": "stage", "stage": "idle", "t": time.time()}])
    row = kept.queue.job_get("v1")
    assert row.status is JobStatus.FAILED and "could not be recorded" in row.error and "Is a directory" in row.error
    assert kept.current == "v2" and _posted(kept)["id"] == "v2"  # the same events went on: the next job taken


def test_one_events_trouble_costs_no_other(kept, tiny_assets, monkeypatch):
    kept.queue.job_insert("v1", kept.spec, 10)
    _idle(kept)

    def broken(*_a, **_k):
        raise RuntimeError("a bad event")

    monkeypatch.setattr(kept, "_rank_record", broken)  # the job's end cannot be handled
    kept.on_events([{"rank": 0, "kind": "job_done", "id": "v1", "t": time.time()},
                    {"rank": 0, "kind": "stage", "stage": "denoise", "t": time.time()},
                    {"rank": 0, "kind": "stage", "stage": "idle", "t": time.time()}])
    assert "a bad event" in kept.last_error and kept.state.value == "idle"
    row = kept.queue.job_get("v1")  # never left in progress with no one making it
    assert row.status is JobStatus.FAILED and "end could not be handled" in row.error, row


def test_a_job_taken_too_often_is_failed_not_run(kept):
    from wan_s2v_runner.serve.store import rules

    kept.queue.job_insert("v1", kept.spec, 10)
    with kept.queue._tx() as db:
        db.execute("UPDATE jobs SET attempt = ? WHERE id = 'v1'", (rules.MAX_ATTEMPTS,))
    _idle(kept)
    row = kept.queue.job_get("v1")
    assert row.status is JobStatus.FAILED and "taken 5 times without an end" in row.error
    assert kept.current is None and not list(inbox.inbox_of(kept.run_dir).glob("job-*.json"))


class ScriptedGroup(InboxDoor):
    """A rank group played by the test through the group interface: its news scripted, its door a
    real inbox folder (submit, cancel, renew, release, stop: :class:`InboxDoor`'s)."""

    def __init__(self, script):
        super().__init__()
        self.script, self.halted = list(script), False

    def start(self):
        pass

    def halt(self):
        self.halted = True

    def events(self, timeout):
        from wan_s2v_runner.serve.group import GroupNews

        news = self.script.pop(0) if self.script else GroupNews(ended=True)
        if news.started is not None:
            self._run_dir = news.started
        return news


@pytest.mark.parametrize("ending", [False, True])
def test_a_group_whose_launcher_reported_its_end_is_handed_no_job(tmp_path, tiny_assets, ending):
    """Rank 0 idle at the supervisor's last poll of a group that is stopping (the launcher already
    reported how it ended): the keeper claims nothing and posts nothing there; the job stays
    queued, its attempts untouched. The same news without the end: the job is posted."""
    from types import SimpleNamespace

    from wan_s2v_runner.serve.dirs import ServerDirs
    from wan_s2v_runner.serve.group import GroupClient, GroupNews, LaunchedGroup
    from wan_s2v_runner.serve.keeper import Keeper
    from wan_s2v_runner.serve.store.sqlite import SqliteJobStore
    from wan_s2v_runner.shared.spec import GroupSpec

    dirs = ServerDirs(tmp_path / "server")
    store = SqliteJobStore(dirs.queue)
    store.job_insert("v1", {"image": str(tiny_assets.image), "audio": str(tiny_assets.audio), "prompt": "p", "seed": 3,
                     "output": str(dirs.videos / "v1.mp4")}, 10)
    run_dir = tmp_path / "run"
    inbox.inbox_of(run_dir).mkdir(parents=True)
    idle = {"rank": 0, "kind": "stage", "stage": "idle", "t": time.time()}
    last = GroupNews(events=[idle], ranks=[], outcome=SimpleNamespace(reason="stopped") if ending else None)
    group = ScriptedGroup([GroupNews(started=run_dir), last, GroupNews(ended=True)])
    # the test's group and the launcher's both speak the whole interface the keeper uses
    assert isinstance(group, GroupClient) and isinstance(LaunchedGroup(GroupSpec(ckpt_dir=tiny_assets.ckpt_dir)),
                                                         GroupClient)
    keeper = Keeper(GroupSpec(ckpt_dir=tiny_assets.ckpt_dir, device="cpu"), store, dirs,
                    new_group=lambda spec, env, name: group)
    try:  # one group's life (then the keeper's back-off of 1 s)
        keeper._one_group()
        posted = list(inbox.inbox_of(run_dir).glob("job-*.json"))
        if ending:
            assert not posted and store.job_get("v1").status is JobStatus.QUEUED and store.job_get("v1").attempt == 0
        else:
            assert len(posted) == 1 and store.job_get("v1").attempt == 1
    finally:
        store.close()
