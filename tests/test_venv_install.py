"""The set-up's installer (``tools/venv_install.py``): uv gets what pip is configured with, or pip
installs. The whole install is what ``make test`` itself runs first (a fresh clone: `.ci/run`)."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("venv_install", ROOT / "tools" / "venv_install.py")
venv_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(venv_install)


def test_pips_settings_become_uvs_options():
    argv, env = venv_install.uv_command("/v/bin/python", "/v/bin/uv", {
        "extra-index-url": "file:///a/simple https://b/simple", "find-links": "/w", "constraint": "/c.txt",
        "cert": "/ca.crt", "index-url": "https://i/simple", "trusted-host": "b", "no-index": "false",
        "default-timeout": "180", "disable-pip-version-check": "1", "no-cache-dir": "1"})
    assert argv[:7] == ["/v/bin/uv", "pip", "install", "--no-config", "--python", "/v/bin/python",
                        "--index-strategy"]
    assert argv[7] == "unsafe-best-match"  # pip's rule: the best version across every index
    pairs = list(zip(argv[8::2], argv[9::2]))
    assert pairs == [("--extra-index-url", "file:///a/simple"), ("--extra-index-url", "https://b/simple"),
                     ("--find-links", "/w"), ("--constraint", "/c.txt"), ("--build-constraint", "/c.txt"),
                     ("--index-url", "https://i/simple"), ("--allow-insecure-host", "b")]
    assert env["SSL_CERT_FILE"] == "/ca.crt" and env["UV_NO_CACHE"] == "1"
    argv, _ = venv_install.uv_command("/p", "/uv", {"no-index": "true"})
    assert "--no-index" in argv


def test_a_setting_uv_would_not_take_the_same_makes_pip_install():
    why = venv_install.uv_command("/p", "/uv", {"find-links": "/w", "prefer-binary": "1"})
    assert why == "pip is configured with prefer-binary='1', which uv would not take the same"


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
    assert "config-file" in got and "--find-links" in venv_install.uv_command(sys.executable, "uv", got)[0]
