"""The status page (``GET /``) in a real headless Chromium (Debian's ``chromium`` through its
``chromedriver``, driven by Selenium), against the session's server on the tiny checkpoint.

It asks for the token once (and keeps it over a reload), shows the layout and both ranks, shows
a bad upload's preflight message next to the image field, sends a text-to-speech voice upload
(refused by this server, which has no CosyVoice, next to ``tts_text``), submits a job through the
form and watches its progress bar move and its video so far play in its row before it ends,
plays the finished video (``duration`` > 0) with its download link, and cancels a second job.
Screenshots of each point go to ``test-artifacts/page/`` (``$WAN_S2V_ARTIFACTS`` elsewhere).
Skips, with the reason, only where no Chromium is installed (``make test`` installs it where it
can: ``tools/ensure_chromium``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from browser import MISSING, chromium
from conftest import ROOT, wait_for
from serving import TOKEN

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
ARTIFACTS = Path(os.environ.get("WAN_S2V_ARTIFACTS", ROOT / "test-artifacts")) / "page"


@pytest.fixture
def browser(tmp_path):
    driver = chromium(tmp_path / "profile")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def shot(driver, name: str) -> None:
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def job_state(driver, job_id: str) -> dict:
    return js(driver, """
        const el = document.querySelector(`[data-id="${arguments[0]}"]`);
        if (!el) return null;
        const v = el.querySelector(".result video");
        const p = el.querySelector(".partial video");
        return {status: el.dataset.status, progress: el.querySelector(".progress-bar").value,
                partial: p ? {ready: p.readyState, duration: p.duration,
                              note: el.querySelector(".partial-note").textContent} : null,
                detail: el.querySelector(".detail").textContent,
                video: v ? {ready: v.readyState, duration: v.duration} : null,
                download: el.querySelector("a.download") ? el.querySelector("a.download").download : null};
    """, job_id)


def submit(driver, image: Path, audio: Path, **fields) -> None:
    from selenium.webdriver.common.by import By

    form = driver.find_element(By.ID, "submit-form")
    for name, path in (("image", image), ("audio", audio)):
        box = form.find_element(By.NAME, name)
        box.clear()
        box.send_keys(str(path))
    for name, value in fields.items():
        box = form.find_element(By.NAME, name)
        box.clear()
        box.send_keys(str(value))
    form.find_element(By.ID, "submit-button").click()


def server_ids(server) -> list[str]:
    return [v["id"] for v in server.videos()]


def newest_job(driver, other_than: set) -> str:
    return wait_for(lambda: next((i for i in js(driver, "return [...document.querySelectorAll('.job')]"
                                                "  .map(e => e.dataset.id)") if i not in other_than), None),
                    30, "the submitted job on the page")


@pytest.mark.slow
def test_status_page_in_chromium(browser, server, inputs, tmp_path):
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{server.url}/")
    # the token, asked once
    wait_for(lambda: js(driver, "return document.getElementById('token-dialog').open"), 30, "the token dialog")
    shot(driver, "01-token")
    driver.find_element(By.ID, "token-input").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    wait_for(lambda: js(driver, "return document.body.dataset.ready === '1'"), 30, "the page to load")
    driver.refresh()  # kept for the session: no second ask
    wait_for(lambda: js(driver, "return document.body.dataset.ready === '1'"), 30, "the page to load again")
    assert not js(driver, "return document.getElementById('token-dialog').open")
    # the server: its layout, both ranks
    layout = driver.find_element(By.ID, "layout").text
    assert "ulysses" in layout and "CFG 1 x SP 2" in layout, layout
    wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#ranks tbody tr")) == 2, 60, "both ranks listed")

    # a bad upload: the preflight's cause and fix next to the image field, nothing queued
    jobs_before = len(server.videos())
    bad = tmp_path / "not an image.png"
    bad.write_bytes(b"this is not a png")
    submit(driver, bad, inputs["audio"])
    slot = driver.find_element(By.CSS_SELECTOR, '[data-error-for="image"]')
    wait_for(lambda: slot.text, 30, "the image field's error")
    assert "preflight inputs.image" in slot.text and "Fix" in slot.text, slot.text
    shot(driver, "02-bad-upload")
    assert len(server.videos()) == jobs_before

    # text-to-speech from the page: the voice prompt is uploaded with the text (no speech audio),
    # so the server goes on to check CosyVoice, which this server lacks: its cause on the page
    # (without the upload the spec itself would refuse: "needs --tts-prompt-audio")
    form = driver.find_element(By.ID, "submit-form")
    form.find_element(By.NAME, "audio").clear()
    form.find_element(By.NAME, "tts_prompt_audio").send_keys(str(inputs["audio"]))
    form.find_element(By.NAME, "tts_text").send_keys("Hello from the page.")
    form.find_element(By.NAME, "image").clear()
    form.find_element(By.NAME, "image").send_keys(str(inputs["image"]))
    form.find_element(By.ID, "submit-button").click()
    said = driver.find_element(By.CSS_SELECTOR, '[data-error-for="tts_text"]')  # the cause, by its field
    wait_for(lambda: "CosyVoice" in said.text, 30, "the text-to-speech refusal by the tts_text field",
             lambda: [e.text for e in driver.find_elements(By.CSS_SELECTOR, "[data-error-for]")])
    assert "preflight inputs.tts" in said.text and "Fix" in said.text, said.text
    shot(driver, "02b-tts-refused")
    assert len(server.videos()) == jobs_before
    form.find_element(By.NAME, "tts_prompt_audio").clear()
    form.find_element(By.NAME, "tts_text").clear()

    # a job through the form: its bar moves, then the video plays
    earlier = set(server_ids(server))
    submit(driver, inputs["image"], inputs["audio"], prompt="from the page", seed=11, steps=24)
    assert slot.text == ""  # the earlier error is cleared
    first = newest_job(driver, earlier)
    seen, shot_taken, partial_seen = [], False, None
    deadline = time.time() + 180
    while time.time() < deadline:
        st = job_state(driver, first)
        seen.append(st["progress"])
        if st["status"] == "in_progress" and 0 < st["progress"] < 100 and not shot_taken:
            shot(driver, "03-progress")
            shot_taken = True
        if st["status"] == "in_progress" and st["partial"] and st["partial"]["ready"] >= 1 and not partial_seen:
            partial_seen = st["partial"]  # the video so far plays in the row before the job ends
            shot(driver, "03b-video-so-far")
        if st["status"] == "completed":
            break
        time.sleep(0.1)
    assert st["status"] == "completed", (st, server.tail())
    assert partial_seen and partial_seen["duration"] > 0 and "1 of 2 clips" in partial_seen["note"], partial_seen
    assert st["partial"] is None  # the whole video replaced it
    moving = sorted({p for p in seen if 0 < p < 100})
    assert len(moving) >= 2 and seen == sorted(seen), seen  # it moved, and only forwards
    st = wait_for(lambda: (s := job_state(driver, first))["video"] and s["video"]["ready"] >= 1 and s, 60,
                  "the video's metadata")
    assert st["video"]["duration"] > 0 and st["download"] == f"{first}.mp4", st
    played = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const v = document.querySelector(`[data-id="${arguments[0]}"] video`);
        v.muted = true;
        v.play().then(() => setTimeout(() => done({paused: v.paused, t: v.currentTime}), 300),
                      (e) => done({error: String(e)}));
    """, first)
    assert played.get("paused") is False and played["t"] > 0, played
    shot(driver, "04-done")

    # a second job, cancelled from the page
    submit(driver, inputs["image"], inputs["audio"], prompt="cancelled from the page", steps=1000, shift=2)
    second = newest_job(driver, earlier | {first})
    wait_for(lambda: job_state(driver, second)["status"] in ("queued", "in_progress"), 30, "the second job")
    driver.find_element(By.CSS_SELECTOR, f'[data-id="{second}"] button.cancel').click()
    wait_for(lambda: job_state(driver, second)["status"] == "cancelled", 60, "the cancel")
    shot(driver, "05-cancelled")
    assert server.video(second)["status"] == "cancelled"
