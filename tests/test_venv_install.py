"""The set-up's installer (``tools/venv_install.py``): pip picks the files, the lock's hashes vouch
for them, uv (or pip) installs them. The whole install is what ``make test`` itself runs first (a
fresh clone: `.ci/run`)."""
from __future__ import annotations

import os
import sys

from tests.conftest import load_tool

venv_install = load_tool("venv_install")


def test_uv_gets_what_reaches_a_url_of_pips_settings():
    """uv is given files by URL: pip's certificate, trusted hosts and cache switch carry over; its
    indexes do not (pip chose the files with them)."""
    argv, env = venv_install.uv_command("/v/bin/python", "/v/bin/uv", {
        "extra-index-url": "file:///a/simple https://b/simple", "find-links": "/w", "constraint": "/c.txt",
        "cert": "/ca.crt", "index-url": "https://i/simple", "trusted-host": "b c", "no-cache-dir": "1"})
    assert argv == ["/v/bin/uv", "pip", "install", "--no-config", "--python", "/v/bin/python",
                    "--allow-insecure-host", "b", "--allow-insecure-host", "c"]
    assert env["SSL_CERT_FILE"] == "/ca.crt" and env["UV_NO_CACHE"] == "1"
    _, env = venv_install.uv_command("/p", "/uv", {"no-cache-dir": "false"})
    assert env.get("UV_NO_CACHE") == os.environ.get("UV_NO_CACHE")


def item(name, version, url, sha):
    return {"metadata": {"name": name, "version": version, "requires_dist": []},
            "download_info": {"url": url, "archive_info": {"hashes": {"sha256": sha} if sha else {}}}}


def test_a_chosen_file_the_lock_does_not_list_is_refused_with_the_fix():
    """pip's pick for torch 2.13.0 (a local CPU build) is checked against the lock's hashes for
    2.13.0; one not listed stops the install with one line naming the file and where to add it."""
    by_version = {("torch", "2.13.0"): {"sha256:" + "a" * 64}, ("numpy", "2.2.6"): {"sha256:" + "b" * 64}}
    chosen = {"torch": item("torch", "2.13.0+cpu", "file:///w/torch-2.13.0%2Bcpu-cp311-x.whl", "c" * 64),
              "numpy": item("numpy", "2.2.6", "https://h/numpy-2.2.6-x.whl", "b" * 64)}
    bad = venv_install.check_hashes(chosen, ["torch", "numpy"], by_version)
    assert bad == [f"venv_install: torch 2.13.0+cpu: pip picked torch-2.13.0+cpu-cp311-x.whl (sha256:{'c' * 64}), "
                   "which requirements.lock does not list for torch==2.13.0; fix: if you trust that build, add its "
                   "hash to EXTRA_BUILDS in tools/lock.py and run make lock"]
    chosen["torch"] = item("torch", "2.13.0+cpu", "file:///w/t.whl", "a" * 64)
    assert venv_install.check_hashes(chosen, ["torch", "numpy"], by_version) == []


def test_the_lock_is_written_back_as_pips_requirements():
    entries = venv_install.lockfile.parse("a==1.0 ; python_version < '3.11' \\\n    --hash=sha256:" + "1" * 64
                                          + "\n    # via -r requirements.txt\n")
    assert venv_install.requirements_text(entries) == f"a==1.0 ; python_version < '3.11' --hash=sha256:{'1' * 64}\n"
    assert venv_install.requirements_text(entries, hashes_of=lambda e: ()) == "a==1.0 ; python_version < '3.11'\n"


def test_pips_settings_are_read_with_pips_precedence(tmp_path, monkeypatch):
    """A variable over the install section over the global one, as pip itself reads them."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /from-global\nconstraint = /c-global\nindex-url = https://g/simple\n"
                    "extra-index-url =\n    https://a/simple\n    https://b/simple\n"
                    "[install]\nconstraint = /c-install\n")
    for name in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_INDEX_URL", "https://env/simple")
    got = venv_install.pip_settings(sys.executable)
    assert got["find-links"] == "/from-global" and got["constraint"] == "/c-install", got
    assert got["index-url"] == "https://env/simple", got
    assert got["extra-index-url"].split() == ["https://a/simple", "https://b/simple"], got  # several lines
    assert "config-file" in got
