"""A served job's video so far, over real HTTP against the session's server (2 real ranks on the
tiny checkpoint): ``wan-s2v submit --preview`` saves it as it goes; while the job runs the video
object says how many clips are playable and ``GET .../content?variant=partial`` serves it (and
``variant=thumbnail`` the first frame) before the job ends; cancelled, the job keeps it and says
so. Every copy is the growing file as far as rank 0 announced it (its ``preview`` events' lengths),
and a Range request gets only what is new. The job is held at its
second clip until it is cancelled (the server's ``HELD`` test fault, on its prompt)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import cli_env, wait_for
from serving import TOKEN

from wan_s2v_runner.shared import exit_codes, media


def _announced(server, vid: str) -> dict[int, int]:
    """clips -> the growing file's length after them, as rank 0 announced it for ``vid`` (its events)."""
    out = {}
    for log in (server.dir / "runs").glob("*/events/rank0.jsonl"):
        for e in map(json.loads, log.read_text().splitlines()):
            if e["kind"] == "preview" and f"{vid}.partial.mp4" in e.get("path", ""):
                out[e["clips"]] = e["bytes"]
    return out


@pytest.mark.slow
def test_the_video_so_far_while_it_runs_and_after_a_cancel(server, inputs, tmp_path):
    dest = tmp_path / "saved here" / "it's mine.mp4"
    dest.parent.mkdir()
    env = {**cli_env(), "WAN_S2V_TOKEN": TOKEN}
    client = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "submit", "--url", server.url, "--preview",
                               "--server-paths", "--image", str(inputs["image"]), "--audio", str(inputs["audio"]),
                               "--infer-frames", "4", "--num-clips", "3", "--steps", "2", "--seed", "3",
                               "--prompt", "watched as it is made (held)", "--output", str(dest)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    try:
        vid = wait_for(lambda: next((v["id"] for v in server.videos() if v["prompt"] == "watched as it is made (held)"),
                                    None), 60, "the submitted job")
        v = wait_for(lambda: (v := server.video(vid))["status"] != "queued" and (v.get("preview_clips") or
                                                                              v["status"] != "in_progress") and v,
                     240, "the first clip's video so far", server.tail)
        assert v["status"] == "in_progress" and v["preview_clips"] == 1 and v["clips"] == 3, v
        part = server.http.get(f"/v1/videos/{vid}/content", params={"variant": "partial"})
        assert part.status_code == 200 and part.headers["content-type"] == "video/mp4", part.text[:300]
        served = tmp_path / "served.partial.mp4"
        served.write_bytes(part.content)
        info = media.probe(served)
        assert info.video_codec == "h264" and info.audio_codec == "aac" and info.n_frames >= 1, info
        assert len(part.content) == _announced(server, vid)[1]  # exactly the first clip's fragment
        assert info.n_frames == 1  # --infer-frames 4: the first clip adds 4 - 3 frames
        again = server.http.get(f"/v1/videos/{vid}/content", params={"variant": "partial"},
                                headers={"Range": f"bytes={len(part.content)}-"})
        assert again.status_code == 416, again.text[:300]  # nothing new while the job is held
        head = server.http.get(f"/v1/videos/{vid}/content", params={"variant": "partial"},
                               headers={"Range": "bytes=0-99"})
        assert head.status_code == 206 and head.content == part.content[:100], head.headers
        thumb = server.http.get(f"/v1/videos/{vid}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
        assert server.http.get(f"/v1/videos/{vid}/content").status_code == 409  # the whole one: not yet

        # the client saves it as it goes; then the job is cancelled: it keeps its video so far
        saved = media.partial_path(dest)
        wait_for(saved.is_file, 60, "the client's copy of the video so far", lambda: client.stderr.read())
        assert server.http.post(f"/v1/videos/{vid}/cancel").status_code == 200
        out, err = client.communicate(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == exit_codes.JOB_FAILED, out + err
    assert f"video so far: {saved}" in err and str(saved) in out.splitlines()[-1], out + err
    v = server.video(vid)
    assert v["status"] == "cancelled" and v["preview_clips"] >= 1, v
    kept = server.http.get(f"/v1/videos/{vid}/content", params={"variant": "partial"})
    assert kept.status_code == 200
    announced = _announced(server, vid)
    assert len(kept.content) == announced[v["preview_clips"]]  # as far as rank 0 wrote it
    copy = saved.read_bytes()  # the client's copy: the same file, as far as one announcement
    assert len(copy) in announced.values() and kept.content.startswith(copy)
    assert not dest.exists()  # no whole video: only the part
