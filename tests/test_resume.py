"""Clip checkpoints and resume: the disk fills during clip 2 of 3 of a 2-rank run, which fails in
one line under its own exit code; `wan-s2v resume` finishes the run (on another layout) and the mp4
is byte-identical to an uninterrupted run's; a resume whose inputs or frame settings differ is
refused before anything is spawned."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import TINY_FLAGS, asset_flags

from wan_s2v_runner.shared import exit_codes, media
from wan_s2v_runner.shared.job_source import SPEC_KEY, JobSource, read_source

THREE_CLIPS = ["--infer-frames", "4", "--num-clips", "3"]


@pytest.mark.slow
def test_a_full_disk_in_clip_2_fails_in_one_line_and_resume_finishes_the_mp4(tiny_assets, held_job_mp4, tmp_path,
                                                                            monkeypatch, capsys):
    """3 clips over 2 real ranks (``serving.HELD_JOB``'s job, whose one-process mp4 is
    ``held_job_mp4``). The disk fills after clip 1 is committed: rank 0's checkpoint of clip 2 meets
    ENOSPC (injected), and so does the launcher's run.json (injected in this process, where the
    launcher runs). The run fails in one line (the filesystem, the clip kept, the fix) under exit
    code disk-full, without a traceback, leaving no temporary; a resume whose inputs or frame
    settings differ is refused before anything spawns; once there is room, `wan-s2v resume` on
    another layout (1 rank) finishes the video byte for byte the uninterrupted run's."""
    import errno
    import os
    from pathlib import Path

    from fault_worker import FAULT_ENV, MODULE, RANK_WORKER_ENV

    from wan_s2v_runner.cli import main as cli
    from wan_s2v_runner.shared import atomic
    from wan_s2v_runner.shared.disk import mount_point

    real_write_text = atomic.write_text

    def write_text(dest, text, durable=False, commit_if=None):
        if Path(dest).name != "run.json":
            return real_write_text(dest, text, durable, commit_if)

        def no_room(tmp):
            tmp.write_bytes(text.encode()[:100])  # what fitted
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return atomic.atomic_write(dest, no_room, durable, commit_if, need=len(text.encode()))

    run_dir_root, out = tmp_path / "runs", tmp_path / "out" / "o.mp4"
    with monkeypatch.context() as m:
        m.setattr(atomic, "write_text", write_text)
        m.setenv(RANK_WORKER_ENV, MODULE)
        m.setenv(FAULT_ENV, "0:clip_checkpoint@2:enospc")
        code = cli.main(["run", *TINY_FLAGS, *asset_flags(tiny_assets), *THREE_CLIPS, "--seed", "8", "--nproc", "2",
                         "--output", str(out), "--runs-root", str(run_dir_root)])
    err = capsys.readouterr().err
    assert code == exit_codes.DISK_FULL, err[-3000:]
    assert not out.exists()
    run_dir = next(run_dir_root.iterdir())
    assert read_source(run_dir) is JobSource.RUN  # the run's own job, as its launcher recorded
    assert json.loads((run_dir / "spec.json").read_text())[SPEC_KEY] == "run"
    said = [line for line in err.splitlines() if line.startswith("wan-s2v: FAILED")]
    assert len(said) == 1, err[-3000:]
    assert ("(disk-full, exit 10): the disk is full (No space left on device): the filesystem at "
            f"{mount_point(out)} ") in said[0], said[0]
    assert f"kept: clip 1 of 3 in {out.parent / 'o.partial.mp4'}" in said[0], said[0]
    assert "the 2 clips left need about" in said[0], said[0]
    assert said[0].endswith(f", then `wan-s2v resume {run_dir}`"), said[0]
    assert "Traceback" not in err and "hint:" not in err
    assert not (run_dir / "run.json").exists() and not list(run_dir.glob(".run.*"))  # nothing half-written
    state = json.loads((run_dir / "clips" / "state.json").read_text())
    assert (state["next_clip"], state["num_clips"]) == (1, 3)  # clip 1 complete, clip 2 was lost

    # inputs that differ from the run that wrote the clips: refused, nothing spawned
    other_audio = tmp_path / "other.wav"
    shutil.copy(tiny_assets.audio, other_audio)
    with open(other_audio, "r+b") as f:
        f.seek(-2, 2)
        f.write(b"\x01\x02")
    assert cli.main(["resume", str(run_dir), "--audio", str(other_audio)]) == exit_codes.USAGE
    assert "inputs or frame settings" in capsys.readouterr().err
    assert cli.main(["resume", str(run_dir), "--steps", "3"]) == exit_codes.USAGE
    assert "--steps cannot change" in capsys.readouterr().err
    assert len(list(run_dir_root.iterdir())) == 1

    code = cli.main(["resume", str(run_dir), "--nproc", "1", "--json"])  # another layout
    got = capsys.readouterr()
    assert code == 0, got.err[-3000:]
    assert "resuming" in got.err and "at clip 2/3" in got.err
    manifest = json.loads(got.out)
    assert manifest["resume"] == {"from": str(run_dir), "at_clip": 2, "clips": 3}
    assert media.sha256_file(out) == held_job_mp4
    assert manifest["output"]["sha256"] == held_job_mp4
