"""The served rank group the tests share: ``wan-s2v serve`` in a subprocess on loopback (one
server for the session, :func:`conftest.server`), its HTTP client, and the reference a served
job's mp4 must equal."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import cli_env, one_process_frames, wait_for

from wan_s2v_runner.shared import media

TOKEN = "s3cret token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: the shared server's jobs: the tiny spec (as TINY_FLAGS) is the server's default
TINY_DEFAULTS = ["--device", "cpu", "--size", "64*64", "--infer-frames", "8", "--steps", "2",
                 "--prompt", "a person talking", "--watchdog-load", "120"]
SERVER_FLAGS = [*TINY_DEFAULTS, "--nproc", "2"]
#: a job that kills rank 1 at its first denoising step (test-only fault, matched on the prompt)
POISON = "1:denoise#poison:exit"
#: a job that raises on both ranks as its denoising starts: a Python error at the same point on
#: every rank (test-only fault, on the prompt): the job's alone, the group goes on
BOOM = "0:denoise#boom:raise,1:denoise#boom:raise"
#: a job whose mp4 cannot be written: the disk full as rank 0 finishes the video (test-only fault, on the prompt)
NO_SPACE = "0:save#nospace:enospc"
#: a job whose disk fills while its video grows: the writer's append of clip 2 (on its thread) meets
#: ENOSPC; the next step's message fails the job on every rank (test-only fault, on the prompt)
MIDWAY = "0:denoise@2#midway:diskfull"
#: a job held at its second clip until the server cancels it (on the prompt): in progress, with its
#: first clip's video so far, for as long as the test needs, however fast the machine
HELD = "0:denoise@2#held:wait"


class ServerProcess:
    """``python -m wan_s2v_runner serve`` in a subprocess; its URL from SERVER_DIR/server.json."""

    def __init__(self, server_dir: Path, flags: list[str], env: dict | None = None):
        self.flags, self.env = flags, env
        self.dir, self.log = server_dir, server_dir.parent / f"{server_dir.name}.{time.time():.0f}.log"
        server_dir.parent.mkdir(parents=True, exist_ok=True)
        (server_dir / "server.json").unlink(missing_ok=True)
        full = cli_env(env)
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "serve", *flags,
                                      "--server-dir", str(server_dir), "--port", "0"],
                                     cwd=server_dir.parent, env=full, stdin=subprocess.DEVNULL,
                                     stdout=self.out, stderr=subprocess.STDOUT)
        wait_for(lambda: (server_dir / "server.json").is_file() or self.proc.poll() is not None, 120, "server.json")
        assert self.proc.poll() is None, self.text()
        self.url = json.loads((server_dir / "server.json").read_text())["url"]
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    def text(self) -> str:
        if not self.out.closed:
            self.out.flush()
        return self.log.read_text()

    def tail(self) -> str:
        """The log's end, for a failed wait."""
        return self.text()[-3000:]

    def video(self, vid: str) -> dict:
        r = self.http.get(f"/v1/videos/{vid}")
        assert r.status_code == 200, r.text
        return r.json()

    def videos(self) -> list[dict]:
        """Every video on the server, oldest first: GET /v1/videos page by page (its cursor), as
        ``wan-s2v jobs`` lists them."""
        from wan_s2v_runner.serve.client import list_all

        return list_all(self.http)

    def submit(self, files: dict | None = None, **fields) -> httpx.Response:
        return self.http.post("/v1/videos", data={k: str(v) for k, v in fields.items()}, files=files)

    def wait(self, vid: str, *states: str, timeout: float = 180) -> dict:
        return wait_for(lambda: (v := self.video(vid))["status"] in states and v, timeout,
                        f"{vid} to be {'/'.join(states)}", self.tail)

    def restart(self) -> None:
        """The server again, in the same directory with the same flags (after a kill, say)."""
        self.http.close()
        self.out.close()
        self.__init__(self.dir, self.flags, self.env)

    def group_dir(self) -> str | None:
        """The run directory of the server's current (or last) rank group."""
        try:
            return json.loads((self.dir / "group.json").read_text())["run_dir"]
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> list[int]:
        """SIGTERM, as a service manager stops it; returns the pids of its rank group still
        running after it exited (none: it stops its group before it exits)."""
        from wan_s2v_runner.serve.leftovers import group_processes

        group = self.group_dir()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.http.close()
        self.out.close()
        left = sorted(group_processes(group)) if group else []
        for pid in left:  # never leave them to the next test
            os.kill(pid, signal.SIGKILL)
        return left


def shared_server(server_dir: Path, ckpt_dir: Path, url: str, shared_dir: Path, lease_s: int, *more: str,
                  env: dict | None = None) -> ServerProcess:
    """A server of a fleet (``--queue URL --shared-dir DIR``), one rank, no token, its group idle."""
    s = ServerProcess(server_dir, [*TINY_DEFAULTS, "--ckpt-dir", str(ckpt_dir), "--nproc", "1", "--queue", url,
                                   "--shared-dir", str(shared_dir), "--lease-s", str(lease_s), *more], env=env)
    s.http.headers.pop("Authorization")
    wait_for(lambda: s.http.get("/health").json()["group"] == "idle", 120, f"{server_dir.name}'s group", s.tail)
    return s


def rank0_events(server_dir: Path, kind: str) -> list[dict]:
    """Every ``kind`` event rank 0 of any of the server's groups wrote."""
    return [e for log in sorted(server_dir.glob("runs/*/events/rank0.jsonl"))
            for e in map(json.loads, log.read_text().splitlines()) if e["kind"] == kind]


#: the 3-clip job held at clip 2 by the shared queue's and the fleet's tests (a form's fields)
HELD_JOB = {"seed": "8", "infer_frames": "4", "num_clips": "3", "steps": "2"}


def expected_mp4(engine_cpu, audio: Path, dest: Path, **updates) -> str:
    """sha256 of the mp4 one process makes for the tiny spec with ``updates``."""
    frames = one_process_frames(engine_cpu, **updates)
    return mp4_of(frames, audio, dest, engine_cpu[2].model_copy(update=updates).infer_frames)


def mp4_of(frames, audio: Path, dest: Path, infer_frames: int = 8, fps: int = 16) -> str:
    """sha256 of the mp4 rank 0 writes for ``frames`` (one process's, made elsewhere) with ``audio``."""
    media.save_video_with_audio(frames, fps, audio, dest, media.clip_lengths(frames.shape[1], infer_frames))
    return media.sha256_file(dest)


