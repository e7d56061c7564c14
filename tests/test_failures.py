"""Torch elastic's error files, read by torch's own ``ProcessFailure``: every file here is written
by torch's ``@record`` / ``ErrorHandler`` (in a subprocess, as a rank does under torchrun), never by
hand, laid out like torchrun's log dir (``logs/<run_id>/attempt_<n>/<local_rank>/error.json``).
No torchrun, no engine import.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wan_s2v_runner.launcher.diagnose import ERROR_FILE, ErrorFile, attribute_failures, read_error_files
from wan_s2v_runner.shared.stages import Stage

ROOT = Path(__file__).resolve().parent.parent

#: what each local rank raises in the writer; ``sys.argv[1:]``: the error file per local rank
WRITER = r'''
import os, sys
from torch.distributed.elastic.multiprocessing.errors import record

def load_weights():
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

@record
def main_oom():
    load_weights()

@record
def main_multiline():
    raise ValueError("first line\nsecond line")

for path, main in zip(sys.argv[1:], (main_oom, main_multiline)):
    os.environ["TORCHELASTIC_ERROR_FILE"] = path  # what torchrun sets for each rank
    try:
        main()
    except Exception:
        pass
    else:
        sys.exit("@record let no exception through")
'''


def _error_path(run_dir: Path, local_rank: int | str, attempt: int = 0) -> Path:
    d = run_dir / "logs" / "abc123_x" / f"attempt_{attempt}" / str(local_rank)
    d.mkdir(parents=True, exist_ok=True)
    return d / "error.json"


@pytest.fixture(scope="module")
def torch_written(tmp_path_factory) -> tuple[Path, int, int]:
    """A run dir with error files for local ranks 0 (an OOM) and 1 (a two-line message), both
    written by torch's ``@record``; and the unix seconds before and after writing them."""
    run_dir = tmp_path_factory.mktemp("run")
    paths = [_error_path(run_dir, 0), _error_path(run_dir, 1)]
    before = int(time.time())
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    proc = subprocess.run([sys.executable, "-c", WRITER, *map(str, paths)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    after = int(time.time())
    assert proc.returncode == 0, proc.stderr
    assert all(p.is_file() for p in paths), proc.stderr
    return run_dir, before, after


def test_the_error_file_of_a_rank_is_read_by_torch(torch_written):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    run_dir, before, after = torch_written
    files = read_error_files(run_dir, rank_offset=2)  # node 1 of 2 nodes with 2 ranks each
    assert sorted(files) == [2, 3]
    ef = files[2]
    assert isinstance(ef, ErrorFile) and isinstance(ef.failure, ProcessFailure)
    assert ef.path == _error_path(run_dir, 0) and ef.local_rank == 0 == ef.failure.local_rank
    assert ef.failure.error_file == str(ef.path)
    assert ef.message == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert ef.error_type == "RuntimeError"
    assert before <= ef.timestamp <= after
    assert ef.traceback.startswith("Traceback (most recent call last):")
    assert "in load_weights" in ef.traceback and ef.traceback.endswith(ef.message)


def test_a_message_of_several_lines_is_kept_whole(torch_written):
    """The handler's own ``Type: message`` line, not the traceback's last line ("second line")."""
    ef = read_error_files(torch_written[0])[1]
    assert ef.message == "ValueError: first line\nsecond line"
    assert ef.error_type == "ValueError"
    assert ef.traceback.endswith("ValueError: first line\nsecond line")


def test_a_rank_that_failed_before_its_first_event_is_told_by_its_error_file(torch_written):
    run_dir, before, after = torch_written
    files = read_error_files(run_dir, rank_offset=2)
    fs = attribute_failures({}, error_files=files, death_times={}, exit_codes={3: 1})
    assert sorted(f.rank for f in fs) == [2, 3]
    oom = next(f for f in fs if f.rank == 2)
    assert (oom.local_rank, oom.source, oom.stage, oom.error_file) == (0, ERROR_FILE, Stage.START,
                                                                       str(_error_path(run_dir, 0)))
    assert before <= oom.timestamp <= after and "in load_weights" in oom.traceback
    assert oom.headline() == ("rank 2 failed before its first event: "
                              "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert oom.hint.startswith("GPU out of memory in start")
    other = next(f for f in fs if f.rank == 3)
    assert other.exitcode == 1 and other.also_line() == "also rank 3 in start: ValueError: first line"


def test_unreadable_missing_and_misplaced_error_files_are_left_out(tmp_path, torch_written, caplog):
    good = _error_path(torch_written[0], 0).read_text()
    _error_path(tmp_path, 0).write_text(good)  # the one readable file
    _error_path(tmp_path, 1).write_text(good[: len(good) // 2])  # cut off (a rank killed mid-write)
    _error_path(tmp_path, 2).write_text("")
    _error_path(tmp_path, 3).write_text('{"message": {"message": "X: y"}}')  # no extraInfo/timestamp
    _error_path(tmp_path, 4).mkdir()  # no file there: torch's "<N/A>" (as when it is gone before reading)
    _error_path(tmp_path, "x").write_text(good)  # not a local rank's directory
    assert _error_path(tmp_path, 4) in set((tmp_path / "logs").glob("*/attempt_*/*/error.json"))
    torch_log = logging.getLogger("torch.distributed.elastic.multiprocessing.errors")
    with caplog.at_level(logging.DEBUG):
        files = read_error_files(tmp_path)
    assert sorted(files) == [0]
    assert files[0].message == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert not [r for r in caplog.records if r.name == torch_log.name and r.levelno >= logging.WARNING]
    assert not torch_log.disabled  # quieted only while reading


def test_no_error_files_reads_nothing_and_imports_no_torch(tmp_path):
    code = ("import sys; from pathlib import Path\n"
            "from wan_s2v_runner.launcher.diagnose import read_error_files\n"
            f"assert read_error_files(Path({str(tmp_path)!r})) == {{}}\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
