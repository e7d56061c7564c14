"""Long videos: what a run holds does not grow with its clips, and a full disk mid-video fails the
run cleanly and ``wan-s2v resume`` finishes it once there is room, byte for byte the video of an
uninterrupted run.

- The real loop (one process, the tiny checkpoint) with the real video writer as its sink: at
  every clip checkpoint the CPU tensors alive in the process are counted (every storage once). From
  the second clip on the count stays within half a clip's frames, where keeping the frames would
  add a whole clip's each time.
- A real ``wan-s2v run`` of 3 clips of 76 frames (clips of at least 73 frames: no last frames in
  the carried state) writes its video onto a 400 KiB tmpfs (a private mount namespace:
  ``unshare``) that fills during clip 2: the run fails naming the full disk and the fix, the
  video so far keeps clip 1 and a half-written clip 2 after it, ``state.json`` names clip 1; the
  tmpfs is made larger and ``wan-s2v resume`` cuts the half clip off and finishes the file.
"""
from __future__ import annotations

import gc
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import ROOT, TINY_FLAGS, cli_env, one_process_frames

from wan_s2v_runner.shared import exit_codes, media

LONG = ["--infer-frames", "76", "--num-clips", "3"]


@pytest.fixture(scope="module")
def long_speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "speech.wav"
    t = np.arange(16000 * 15) / 16000  # 3 clips of 76 frames need 225 frames: 14.1 s
    sf.write(path, (0.3 * np.sin(2 * np.pi * 180 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32),
             16000)
    return path


def _cpu_tensor_bytes() -> int:
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            s = obj.untyped_storage()
            ptr, n = s.data_ptr(), s.nbytes()
        except Exception:  # a tensor without real storage (a compile test's fake tensors)
            continue
        if ptr not in seen:
            seen.add(ptr)
            total += n
    return total


@pytest.mark.slow
def test_the_loops_memory_is_flat_in_the_clip_count(engine_cpu, tiny_assets, long_speech, tmp_path):
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.job_shell import Hooks, JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.video_writer import VideoWriter
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode

    class Events:
        def emit(self, kind, **data):
            pass

    class Measured(VideoWriter):  # the real writer, counting what the process holds at each checkpoint
        held: list[int] = []

        def clip_done(self, state, num_clips):
            super().clip_done(state, num_clips)
            gc.collect()
            self.held.append(_cpu_tensor_bytes())

    wan, cfg, spec = engine_cpu
    spec = spec.model_copy(update={"audio": long_speech, "infer_frames": 16, "num_clips": 7})
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                            components.LoadSettings.of(spec))
    writer = Measured(tmp_path / "o.mp4", long_speech, cfg.sample_fps, tmp_path / "run", {"spec": "x"}, Events())
    JobShell(parts, plan, Hooks(sink=writer)).generate(request_for(spec))
    out = writer.finish()
    info = media.probe(out)
    clip_bytes = 3 * 16 * info.height * info.width * 4  # one clip's float32 frames
    assert info.n_frames == 7 * 16 - 3, info
    held = writer.held[1:]  # from the second clip on (the first one's warm-up allocations aside)
    assert len(held) == 6 and max(held) - min(held) < clip_bytes // 2, (held, clip_bytes)


def _in_private_mount_namespace(script: str, tmp_path) -> subprocess.CompletedProcess:
    """``script`` (bash) in a mount namespace of its own, where it may mount a tmpfs: as root
    ``unshare -m``, else ``unshare -rm`` (a user namespace that maps this user to root)."""
    flags = "-m" if os.geteuid() == 0 else "-rm"
    return subprocess.run(["unshare", flags, "bash", "-c", script], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_a_full_disk_mid_video_fails_cleanly_and_resume_finishes_it(engine_cpu, tiny_assets, long_speech, tmp_path,
                                                                    spawned_agent):
    """(Its ranks are the launcher's children, in its mount namespace: not forked by the session's
    warm agent, which lives outside it.)"""
    frames = one_process_frames(engine_cpu, audio=long_speech, infer_frames=76, num_clips=3)
    whole = tmp_path / "whole.mp4"  # the uninterrupted run's video
    media.save_video_with_audio(frames, 16, long_speech, whole, media.clip_lengths(frames.shape[1], 76))

    disk, runs, logs = tmp_path / "disk", tmp_path / "runs", tmp_path / "logs"
    for d in (disk, logs):
        d.mkdir()
    run = [sys.executable, "-m", "wan_s2v_runner", "run", *TINY_FLAGS, *LONG, "--nproc", "1",
           "--ckpt-dir", str(tiny_assets.ckpt_dir), "--image", str(tiny_assets.image), "--audio", str(long_speech),
           "--output", str(disk / "o.mp4"), "--runs-root", str(runs)]
    q = shlex.quote
    script = f"""
        set -u
        mount -t tmpfs -o size=400k tmpfs {q(str(disk))} || exit 90
        {shlex.join(run)} > {q(str(logs / 'run.out'))} 2> {q(str(logs / 'run.err'))}
        echo $? > {q(str(logs / 'run.rc'))}
        cp {q(str(disk / 'o.partial.mp4'))} {q(str(logs / 'so_far.mp4'))}
        run_dir=$(ls -d {q(str(runs))}/*)
        cp "$run_dir/clips/state.json" {q(str(logs / 'state.json'))}
        mount -o remount,size=8m {q(str(disk))}   # room again
        {shlex.join([sys.executable, '-m', 'wan_s2v_runner', 'resume'])} "$run_dir" --json \
            > {q(str(logs / 'resume.out'))} 2> {q(str(logs / 'resume.err'))}
        echo $? > {q(str(logs / 'resume.rc'))}
        cp {q(str(disk / 'o.mp4'))} {q(str(logs / 'o.mp4'))}
        ls -a {q(str(disk))} > {q(str(logs / 'left'))}
    """
    p = _in_private_mount_namespace(script, tmp_path)
    assert p.returncode == 0, f"the namespace script failed ({p.returncode}): {p.stderr[-2000:]}"
    out = lambda name: (logs / name).read_text()  # noqa: E731
    assert int(out("run.rc")) == exit_codes.DISK_FULL, out("run.err")[-3000:]
    err = out("run.err")
    assert "No space left on device" in err and "Fix: free space" in err and "wan-s2v resume" in err, err[-3000:]
    assert f"the filesystem at {disk} " in err and "Traceback" not in err, err[-3000:]  # the tmpfs, one line
    state = json.loads(out("state.json"))
    assert state["next_clip"] == 1 and state["video"]["ends"] == [73]  # clip 1 is kept; clip 2 was not written
    so_far = logs / "so_far.mp4"
    assert so_far.stat().st_size > state["video"]["position"]["size"]  # half of clip 2 after it, cut on resume
    assert int(out("resume.rc")) == 0, out("resume.err")[-3000:]
    assert json.loads(out("resume.out"))["resume"]["at_clip"] == 2
    assert (logs / "o.mp4").read_bytes() == whole.read_bytes()
    assert sorted(out("left").split()) == [".", "..", "o.mp4"]  # no partial file, no temporary


def test_unshare_is_there():
    """The full-disk test's tool (util-linux): its absence is a set-up fault, not a skip."""
    assert subprocess.run(["unshare", "--version"], capture_output=True).returncode == 0, \
        f"unshare (util-linux) is missing; {ROOT}/README.md lists the system tools"
