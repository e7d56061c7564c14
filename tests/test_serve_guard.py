"""A server left running is safe from web pages and bad numbers, and alone in its directory
(issue #38's first items), over real HTTP on loopback.

The server without a token here runs the stub rank (tests/stub_rank.py): what is tested happens in
the HTTP layer and the server's start, before any job reaches the ranks. The token server is the
session's shared one (conftest.server)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import STUB_RANKS, cli_env
from serving import TINY_DEFAULTS, TOKEN, ServerProcess

from wan_s2v_runner.shared import exit_codes, media


@pytest.fixture(scope="module")
def open_server(tiny_assets, tmp_path_factory):
    """``wan-s2v serve`` without a token (loopback), its ranks the stub's."""
    d = tmp_path_factory.mktemp("open") / "server dir"
    s = ServerProcess(d, [*TINY_DEFAULTS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--nproc", "1"], env=STUB_RANKS)
    yield s
    assert s.stop() == []


@pytest.mark.slow
def test_without_a_token_pages_of_other_sites_are_refused(open_server):
    url, port = open_server.url, open_server.url.rsplit(":", 1)[1]
    plain = httpx.Client(base_url=url, timeout=30)  # no token: curl, a client, the page itself
    assert plain.get("/v1/videos").status_code == 200
    assert plain.get("/v1/videos", headers={"Host": f"localhost:{port}"}).status_code == 200

    # DNS rebinding: the attacker's name resolves to 127.0.0.1; the browser sends its own Host
    r = plain.get("/v1/videos", headers={"Host": f"evil.example:{port}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site"
    assert "--allow-host evil.example" in r.json()["error"]["message"]
    assert plain.get("/health", headers={"Host": f"evil.example:{port}"}).status_code == 403

    # a cross-site form POST (no CORS preflight): refused before the body is read
    form = {"prompt": "from a web page", "image": "/etc/hostname", "audio": "/etc/hostname"}
    r = plain.post("/v1/videos", data=form, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "http://evil.example" in r.json()["error"]["message"]
    r = plain.post("/v1/videos", data=form, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    r = plain.post("/v1/videos", data=form, headers={"Origin": "null"})  # a sandboxed frame
    assert r.status_code == 403
    assert plain.get("/v1/videos").json()["data"] == []  # nothing was queued

    # the page's own requests (same origin) pass the guard, and get the API's own answer (this
    # server takes no paths: uploads only)
    r = plain.post("/v1/videos", data=form, headers={"Origin": url, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 403 and r.json()["error"]["code"] is None
    assert "this server takes no paths" in r.json()["error"]["message"]


@pytest.mark.slow
def test_form_limits_nul_and_idempotent_submissions(open_server, tiny_assets):
    """A form's fields take what a JSON body takes; a NUL character is refused on every store; a
    request sent again with its Idempotency-Key gives the first job (another request under it: 409)."""
    plain = httpx.Client(base_url=open_server.url, timeout=30)
    files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
             "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
    before = len(plain.get("/v1/videos", params={"limit": 100}).json()["data"])
    uploads = open_server.dir / "uploads"
    kept = {p.name for p in uploads.iterdir()} if uploads.is_dir() else set()
    long = "x" * (70 * 1024)  # over the 64 KiB a JSON body may hold whole
    r = plain.post("/v1/videos", files=files, data={"prompt": long})
    assert r.status_code == 413 and "64 KiB" in r.json()["error"]["message"], r.text
    r = plain.post("/v1/videos", json={"prompt": long, "image": "/x.png", "audio": "/x.wav"})
    assert r.status_code == 413, r.text
    for body in ({"data": {"prompt": "a\x00b"}, "files": files}, {"json": {"prompt": "a\u0000b"}}):
        r = plain.post("/v1/videos", **body)
        assert r.status_code == 422 and r.json()["error"]["param"] == "prompt" and "NUL" in r.text, r.text
    key = {"Idempotency-Key": "retry-me-1"}
    first = plain.post("/v1/videos", files=files, data={"prompt": "once"}, headers=key)
    again = plain.post("/v1/videos", files=files, data={"prompt": "once"}, headers=key)
    assert first.status_code == again.status_code == 200 and first.json()["id"] == again.json()["id"]
    other = plain.post("/v1/videos", files=files, data={"prompt": "another"}, headers=key)
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key", other.text
    r = plain.post("/v1/videos", files=files, headers={"Idempotency-Key": "has space"})
    assert r.status_code == 400, r.text
    assert len(plain.get("/v1/videos", params={"limit": 100}).json()["data"]) == before + 1
    assert {p.name for p in uploads.iterdir()} - kept == {first.json()["id"]}  # the retry's own uploads went


@pytest.mark.slow
def test_a_second_server_on_the_directory_exits_3_and_the_first_is_untouched(open_server, tiny_assets):
    root = open_server.dir
    assert stat.S_IMODE(root.stat().st_mode) == 0o700  # the user's alone
    for name in ("jobs.sqlite", "server.json", "server.lock"):
        assert stat.S_IMODE((root / name).stat().st_mode) & 0o077 == 0, name
    r = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "serve", *TINY_DEFAULTS, "--ckpt-dir",
                        str(tiny_assets.ckpt_dir), "--nproc", "1", "--server-dir", str(root), "--port", "0"],
                       env=cli_env(STUB_RANKS), capture_output=True, text=True, timeout=120)
    assert r.returncode == exit_codes.PREFLIGHT == 3, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: another wan-s2v serve (pid {open_server.proc.pid}) uses the server directory {root}. "
                     "Fix: stop it, or give this server its own --server-dir"], r.stderr
    assert open_server.proc.poll() is None
    assert httpx.get(f"{open_server.url}/health").json()["status"] == "ok"
    assert json.loads((root / "server.json").read_text())["pid"] == open_server.proc.pid


@pytest.mark.slow
def test_numbers_are_finite_and_in_range(server, inputs):
    paths = {"image": str(inputs["image"]), "audio": str(inputs["audio"])}
    raw = '{"image": "%s", "audio": "%s", "shift": NaN}' % (paths["image"], paths["audio"])
    r = server.http.post("/v1/videos", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "NaN is not a number JSON allows" in r.json()["error"]["message"]
    for field, value in (("guide_scale", "inf"), ("shift", "-Infinity"), ("shift", "nan")):
        r = server.submit(**paths, **{field: value})
        assert r.status_code == 422 and r.json()["error"]["param"] == field, r.text
        assert "finite" in r.json()["error"]["message"]
    r = server.submit(**paths, steps=5000)
    assert r.status_code == 422 and "less than or equal to 1000" in r.json()["error"]["message"]
    r = server.submit(**paths, steps=40, shift=50)  # each in range, together a schedule upstream's UniPC fails on
    assert r.status_code == 422 and "Fix: --steps 21 or fewer" in r.json()["error"]["message"], r.text
    deep = {**paths, "prompt": [[[[["deep"]]]]]}
    r = server.http.post("/v1/videos", json=deep)
    assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]
    r = server.http.post("/v1/videos", json={**paths, "prompt": "x" * 100_000})
    assert r.status_code == 413


@pytest.mark.slow
def test_the_token_from_a_file(server, tmp_path):
    """``--token-file`` (the token off the command line, where ``ps`` shows it)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    env = {k: v for k, v in cli_env().items() if k != "WAN_S2V_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "jobs", "--url", server.url, "--token-file",
                        str(token_file), "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), list)
    r = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "jobs", "--url", server.url, "--token-file",
                        str(tmp_path / "absent")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == exit_codes.USAGE and "cannot read the token file" in r.stderr


def test_the_guard_rules():
    from wan_s2v_runner.serve.app import BrowserGuard

    guard = BrowserGuard(app=None, allow_hosts=("S2V.lan",))
    ok = [{"host": "127.0.0.1:8000"}, {"host": "[::1]:8000"}, {"host": "localhost"}, {"host": "10.1.2.3:80"},
          {"host": "s2v.lan:8000"}, {"host": "s2v.lan:8000", "origin": "http://s2v.lan:8000"}]
    bad = [{"host": "evil.example:8000"}, {"host": "127.0.0.1.evil.example"}, {"host": ""},
           {"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:9999"},
           {"host": "127.0.0.1:8000", "sec-fetch-site": "cross-site"}]
    assert [guard.refusal(h) for h in ok] == [None] * len(ok)
    assert all(guard.refusal(h) for h in bad)


def test_durable_writes_reach_the_disk_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    """The mp4 and a job's record: file data fsynced, renamed, then the directory fsynced."""
    from wan_s2v_runner.shared import atomic

    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dest = tmp_path / "video_1.json"
    atomic.write_text(dest, "{}", durable=True)
    tmp = atomic.temp_name(dest)
    assert calls == [("fsync", str(tmp)), ("replace", str(dest)), ("fsync", str(tmp_path))]
    calls.clear()
    atomic.write_text(tmp_path / "plain.txt", "x")  # not durable: no fsync
    assert calls == [("replace", str(tmp_path / "plain.txt"))]


@pytest.mark.slow
def test_a_job_whose_input_is_gone_fails_alone_and_the_ranks_go_on(server, inputs):
    """An input under --allow-dir removed between acceptance and its turn: that job fails with its
    cause; the same ranks (no restart) make the next job."""
    import httpx as _httpx
    from conftest import wait_for

    before = _httpx.get(f"{server.url}/health").json()
    long = server.submit(image=inputs["image"], audio=inputs["audio"], steps=1000, shift=2,
                         prompt="holds the group").json()
    wait_for(lambda: (server.video(long["id"]).get("step") or 0) >= 1, 120, "the long job's first step", server.tail)
    vanishing = inputs["root"] / "vanishing.png"
    vanishing.write_bytes(inputs["image"].read_bytes())
    gone = server.submit(image=vanishing, audio=inputs["audio"], prompt="its image will be gone")
    assert gone.status_code == 200, gone.text
    vanishing.unlink()
    server.http.post(f"/v1/videos/{long['id']}/cancel")
    failed = server.wait(gone.json()["id"], "failed", "completed", timeout=120)
    assert failed["status"] == "failed", failed
    assert "image" in failed["error"]["message"] and "gone or empty" in failed["error"]["message"]
    after = server.submit(image=inputs["image"], audio=inputs["audio"], steps=1, infer_frames=4, num_clips=1).json()
    assert server.wait(after["id"], "completed")["attempts"] == 1
    health = _httpx.get(f"{server.url}/health").json()
    assert (health["groups"], health["restarts"]) == (before["groups"], before["restarts"])  # the same ranks


@pytest.mark.slow
def test_an_event_stream_always_reaches_an_end(open_server, tiny_assets):
    """A stream whose job can no longer be read ends with an ``error`` event, not silence."""
    import sqlite3
    import threading

    plain = httpx.Client(base_url=open_server.url, timeout=30)
    files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
             "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
    r = plain.post("/v1/videos", files=files, data={"prompt": "followed"})
    assert r.status_code == 200, r.text
    vid = r.json()["id"]  # the stub's ranks never make it: it stays queued or in progress
    seen: list[tuple[str, dict]] = []

    def follow():
        event = None
        with plain.stream("GET", f"/v1/videos/{vid}/events", timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    seen.append((event, json.loads(line[5:])))

    reader = threading.Thread(target=follow)
    reader.start()
    from conftest import wait_for
    wait_for(lambda: seen, 30, "the stream's first event")
    with sqlite3.connect(open_server.dir / "jobs.sqlite") as db:  # the row goes (a later delete, a bug)
        db.execute("DELETE FROM jobs WHERE id = ?", (vid,))
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end"
    assert seen[0][0] == "video" and seen[-1][0] == "error"
    assert seen[-1][1]["error"]["code"] == "404" and vid in seen[-1][1]["error"]["message"]


@pytest.mark.slow
def test_a_full_disk_fails_the_job_alone_and_a_nearly_full_one_refuses_jobs(server, inputs, tiny_assets,
                                                                            tmp_path_factory):
    """ENOSPC at rank 0's real write (finishing the video, injected): that job fails with the cause and the fix,
    the same ranks make the next job. ENOSPC as the video grows (the writer's append of clip 2 of 3,
    on its thread): the next step's message ends the job on both ranks, it fails with the cause and
    the served fix, and the group stays (no restart). A server whose disk has less than
    --min-free-mb free refuses new jobs with 507 and goes on answering."""
    before = httpx.get(f"{server.url}/health").json()
    small = {"image": inputs["image"], "audio": inputs["audio"], "steps": 1, "infer_frames": 4, "num_clips": 1}
    full = server.submit(**small, prompt="nospace: the disk fills as the video is finished").json()
    failed = server.wait(full["id"], "failed", "completed")
    assert failed["status"] == "failed", failed
    message = failed["error"]["message"]
    assert "stage save" in message and "No space left on device" in message and "Fix: free space" in message
    # its record (failed, with the cause), its first frame (made after clip 1) and its video so far
    # (every clip it made: the growing file, kept as a failed job's is); no mp4, no temporary, no
    # clip checkpoints
    left = sorted(p.name for p in (server.dir / "videos").glob(f"*{full['id']}*"))
    assert left == [f"{full['id']}.json", f"{full['id']}.partial.mp4", f"{full['id']}.thumbnail.jpg"], left
    assert media.probe(server.dir / "videos" / f"{full['id']}.partial.mp4").n_frames == 1  # its one clip
    assert json.loads((server.dir / "videos" / f"{full['id']}.json").read_text())["status"] == "failed"
    midway = server.submit(**{**small, "num_clips": 3}, prompt="midway: the disk fills as the video grows").json()
    failed = server.wait(midway["id"], "failed", "completed")
    assert failed["status"] == "failed", failed
    message = failed["error"]["message"]
    assert "appending clip 2" in message and "No space left on device" in message, message
    assert "submit the job again" in message and "wan-s2v resume" not in message, message
    after = server.submit(**small, prompt="room again").json()
    assert server.wait(after["id"], "completed")["status"] == "completed"
    health = httpx.get(f"{server.url}/health").json()
    assert (health["groups"], health["restarts"]) == (before["groups"], before["restarts"])

    d = tmp_path_factory.mktemp("nearly full") / "server dir"
    tight = ServerProcess(d, [*TINY_DEFAULTS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--nproc", "1",
                              "--min-free-mb", str(10**9)], env=STUB_RANKS)  # more than any disk here has
    try:
        files = {"image": ("face.png", tiny_assets.image.read_bytes(), "image/png"),
                 "audio": ("voice.wav", tiny_assets.audio.read_bytes(), "audio/wav")}
        r = httpx.post(f"{tight.url}/v1/videos", files=files, data={"prompt": "no room"}, timeout=30)
        assert r.status_code == 507 and r.json()["error"]["type"] == "insufficient_storage"
        assert "nearly full" in r.json()["error"]["message"] and "--keep-videos" in r.json()["error"]["message"]
        assert httpx.get(f"{tight.url}/health").json()["status"] == "ok"
        assert not (d / "uploads").exists() or not list((d / "uploads").iterdir())  # nothing written
    finally:
        assert tight.stop() == []


def test_retention_keeps_the_newest_and_the_young(tmp_path):
    """--keep-videos and --keep-hours on a real queue file and real files: the jobs due go whole."""
    from wan_s2v_runner.serve.dirs import ServerDirs
    from wan_s2v_runner.serve.retention import Retention, sweep
    from wan_s2v_runner.serve.store.protocol import JobStatus
    from wan_s2v_runner.serve.store.sqlite import SqliteJobStore

    dirs = ServerDirs(tmp_path)
    queue = SqliteJobStore(dirs.queue)
    ids = [f"video_{i:024x}" for i in range(5)]
    for i, job_id in enumerate(ids):
        queue.job_insert(job_id, {"prompt": str(i)}, 100)
        claimed = queue.job_claim_next()
        assert claimed.id == job_id
        queue.job_finish(job_id, claimed.attempt, JobStatus.COMPLETED if i % 2 == 0 else JobStatus.FAILED,
                     record={"id": job_id})
        for path in (dirs.videos / f"{job_id}.mp4", dirs.videos / f"{job_id}.json", dirs.work(job_id) / "clips" / "a",
                     dirs.uploads / job_id / "image.png"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
    queue.job_insert("video_queued", {"prompt": "waits"}, 100)  # not ended: never swept

    def left() -> list[str]:
        return [job_id for job_id in ids if queue.job_get(job_id) is not None]

    assert sweep(Retention(), queue, dirs) == [] and left() == ids  # neither limit: keep all
    assert sweep(Retention(keep=3), queue, dirs) == ids[:2] and left() == ids[2:]
    for job_id in ids[:2]:
        assert not list(dirs.videos.glob(f"{job_id}*")) and not dirs.work(job_id).exists()
        assert not (dirs.uploads / job_id).exists()
    assert (dirs.videos / f"{ids[2]}.mp4").exists()
    now = queue.job_get(ids[-1]).finished_at
    assert Retention(max_age_s=3600).expires_at(now) == int(now + 3600)
    assert sweep(Retention(max_age_s=3600), queue, dirs, now=now + 1800) == []  # young
    assert sweep(Retention(max_age_s=3600), queue, dirs, now=now + 7200) == ids[2:] and left() == []
    assert queue.job_get("video_queued").status is JobStatus.QUEUED


@pytest.mark.slow
def test_an_upload_over_the_limit_is_refused_while_it_streams(server, inputs):
    """A 64 MB upload to a server taking 1 MB: refused (413) once the first megabyte is over; the
    server process writes (spools) no more than that plus a chunk, not the 64 MB it was sent
    (its bytes written, /proc/PID/io, around the request); nothing queued, nothing in uploads/."""
    chunk = b"\0" * (256 << 10)

    def body():
        yield (b"--b\r\nContent-Disposition: form-data; name=\"audio\"; filename=\"big.wav\"\r\n"
               b"Content-Type: audio/wav\r\n\r\n")
        for _ in range(256):  # 64 MB
            yield chunk
        yield b"\r\n--b--\r\n"

    def written() -> int:
        io = dict(line.split(": ") for line in (Path("/proc") / str(server.proc.pid) / "io").read_text().splitlines())
        return int(io["wchar"])

    def uploads() -> set:
        return {p for p in (server.dir / "uploads").rglob("*") if p.is_file()}

    before, wrote, files = len(server.videos()), written(), uploads()
    r = server.http.post("/v1/videos", content=body(), headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413 and "audio: the upload is over 1 MB" in r.json()["error"]["message"], r.text
    wrote = written() - wrote
    assert wrote < 4 << 20, f"the server wrote {wrote >> 20} MB for a refused upload"
    assert len(server.videos()) == before
    assert uploads() <= files  # nothing of this request (other jobs' uploads may come and go)


@pytest.mark.slow
def test_media_over_the_limits_are_refused_by_their_headers(server, inputs, tmp_path):
    """Small files that would decode to gigabytes: two hours of FLAC silence and a 64-megapixel
    PNG, each well under the 1 MB upload limit, refused (413) from their headers, before any
    decode; nothing queued, nothing of theirs left."""
    import numpy as np
    import soundfile
    from PIL import Image

    long_audio = tmp_path / "two hours.flac"
    soundfile.write(long_audio, np.zeros(8000 * 7200, dtype="int16"), 8000, format="FLAC")
    huge_image = tmp_path / "huge.png"
    Image.new("L", (8000, 8000)).save(huge_image)
    assert long_audio.stat().st_size < 1 << 20 and huge_image.stat().st_size < 1 << 20
    before = len(server.videos())
    files_before = {p for p in (server.dir / "uploads").rglob("*") if p.is_file()}
    r = server.submit(files={"audio": ("two hours.flac", long_audio.read_bytes(), "audio/flac")},
                      image=inputs["image"])
    assert r.status_code == 413 and r.json()["error"]["param"] == "audio", r.text
    assert "audio: 7200 s long; this server takes at most 600 s (--max-audio-s)" in r.json()["error"]["message"]
    r = server.submit(files={"image": ("huge.png", huge_image.read_bytes(), "image/png")}, audio=inputs["audio"])
    assert r.status_code == 413 and r.json()["error"]["param"] == "image", r.text
    assert "image: 8000x8000 is 64 MP; this server takes at most 40 MP" in r.json()["error"]["message"]
    assert len(server.videos()) == before
    assert {p for p in (server.dir / "uploads").rglob("*") if p.is_file()} <= files_before
