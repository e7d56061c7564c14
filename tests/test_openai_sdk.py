"""The official ``openai`` SDK's video calls against the server, as users' code makes them
(``client.videos``): create with ``input_reference``, ``size`` and ``seconds`` (our own fields
through ``extra_body``), create_and_poll, retrieve, list with its cursor pages, download_content
(the mp4 and ``variant="thumbnail"``), delete (the video, its files and its record), and our
refusals arriving as the SDK's typed errors with our cause and fix."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import wait_for
from serving import TOKEN

pytestmark = pytest.mark.slow


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=120) as c:
        yield c


def test_create_poll_download_list_and_delete(client, server, inputs):
    with open(inputs["image"], "rb") as image:
        video = client.videos.create_and_poll(
            prompt="from the SDK", input_reference=image, size="64x64", seconds="1", poll_interval_ms=250,
            extra_body={"audio": str(inputs["audio"]), "seed": 5, "steps": 1})
    assert video.status == "completed" and video.progress == 100 and video.object == "video"
    assert video.prompt == "from the SDK" and re.fullmatch(r"video_[0-9a-f]{24}", video.id)
    # 1 s at 16 fps with 8-frame clips asks for 3 clips (3 * 8 - 3 = 21 frames); the engine never runs
    # past the speech (about a second here): the video's own length and size are what it reports
    record = json.loads((server.dir / "videos" / f"{video.id}.json").read_text())
    assert record["spec"]["num_clips"] == 3
    frames = server.video(video.id)["frames"]
    assert video.seconds == f"{frames[1] / 16:g}" and video.size == f"{frames[3]}x{frames[2]}"
    assert client.videos.retrieve(video.id).status == "completed"

    mp4 = client.videos.download_content(video.id).read()
    server_sha = server.video(video.id)["sha256"]
    import hashlib
    assert hashlib.sha256(mp4).hexdigest() == server_sha
    thumb = client.videos.download_content(video.id, variant="thumbnail").read()
    assert thumb[:2] == b"\xff\xd8"  # a JPEG

    # the cursor pages (one more video, cancelled at once, so there are at least two): one at a
    # time, newest first, every video once
    with open(inputs["image"], "rb") as image:
        other = client.videos.create(prompt="another", input_reference=image,
                                     extra_body={"audio": str(inputs["audio"]), "steps": 1000, "shift": 2})
    assert server.http.post(f"/v1/videos/{other.id}/cancel").status_code == 200
    assert client.videos.poll(other.id, poll_interval_ms=100).status == "cancelled"  # poll ends on it
    first = client.videos.list(limit=1)
    assert [v.id for v in first.data] == [other.id] and first.has_more and first.last_id == other.id
    every = [v.id for v in client.videos.list(limit=1)]  # the SDK follows the pages itself
    assert sorted(every) == sorted(v["id"] for v in server.videos()) and len(every) == len(set(every))
    assert [v.id for v in client.videos.list(limit=100, order="asc")] == [v["id"] for v in server.videos()][:100]

    gone = client.videos.delete(video.id)
    assert gone.deleted and gone.object == "video.deleted" and gone.id == video.id
    with pytest.raises(openai.NotFoundError, match=f"no video '{video.id}'"):
        client.videos.retrieve(video.id)
    videos = server.dir / "videos"
    assert not list(videos.glob(f"{video.id}*")) and not (videos / ".work" / video.id).exists()


def test_refusals_are_the_sdks_typed_errors(client, inputs):
    with open(inputs["image"], "rb") as image:
        with pytest.raises(openai.UnprocessableEntityError, match="less than or equal to 1000"):
            client.videos.create(prompt="too many steps", input_reference=image,
                                 extra_body={"audio": str(inputs["audio"]), "steps": 5000})
        image.seek(0)
        with pytest.raises(openai.UnprocessableEntityError, match="seconds: '-1' is not a length"):
            client.videos.create(prompt="negative", input_reference=image, seconds="-1",
                                 extra_body={"audio": str(inputs["audio"])})
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content("video_" + "0" * 24)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).videos.list()


def test_deleting_a_running_video_cancels_it_and_removes_it_when_it_stops(client, server, inputs):
    with open(inputs["image"], "rb") as image:
        video = client.videos.create(prompt="deleted while it runs", input_reference=image,
                                     extra_body={"audio": str(inputs["audio"]), "steps": 1000, "shift": 2})
    wait_for(lambda: (server.video(video.id).get("step") or 0) >= 1, 120, "its first step", server.tail)
    before = httpx.get(f"{server.url}/health").json()
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    assert video.id not in [v["id"] for v in server.videos()]
    work = server.dir / "videos" / ".work" / video.id
    wait_for(lambda: httpx.get(f"{server.url}/health").json()["current"] is None and not work.exists(), 60,
             "the ranks to stop it and its files to go", server.tail)
    health = httpx.get(f"{server.url}/health").json()
    assert (health["groups"], health["restarts"]) == (before["groups"], before["restarts"])
    assert not list((server.dir / "videos").glob(f"{video.id}*"))
    assert not (server.dir / "uploads" / video.id).exists()
