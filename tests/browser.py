"""Headless Chromium for the page's tests (Debian's ``chromium`` through its ``chromedriver``, driven
by Selenium): one way to start it, for the status page (tests/test_page.py) and the session panel
with a fake microphone (tests/test_session_webrtc.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
#: why a page test cannot run here (None: it can)
MISSING = None if (CHROMIUM and CHROMEDRIVER) else (
    "no Chromium and ChromeDriver here (tools/ensure_chromium installs Debian's chromium and chromium-driver "
    "where it can)")


def chromium(profile: Path, height: int = 1200, *extra: str):
    """A headless Chromium (its profile in ``profile``), the window 1280 wide, with ``extra`` flags."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--autoplay-policy=no-user-gesture-required", f"--window-size=1280,{height}",
                *extra, f"--user-data-dir={profile}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    return driver
