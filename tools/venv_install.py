"""``pip install ARGS`` into the venv whose Python runs this script, done by uv where uv can be had,
with pip's own configuration; by pip otherwise. (Makefile helper: the set-up's installs.)

    .venv/bin/python tools/venv_install.py -r requirements.txt -r requirements-dev.txt
    .venv/bin/python tools/venv_install.py --no-deps wan22==2.2.11

**Why uv.** A fresh clone's set-up installed the requirements with pip in 38.7 s on a 2-core
machine with pip's cache warm (27.5 CPU-s: pip unpacks and copies every file of torch and ~110 more
packages); uv installed the same versions in 8.1 s with its cache cold and 1.1 s warm (it links
files from its cache and works in parallel). Every ``make test`` and ``make demo`` from a fresh
clone, and CI, pays this.

**uv sees what pip would.** uv does not read pip's configuration, and what a machine's pip is
configured with decides which torch it gets (a CPU build from a local folder, say, where PyPI's
Linux wheel is the CUDA build). So pip's settings (``pip config list``: its files and ``PIP_*``
variables) are passed to uv, and nothing else (``--no-config``: no ``uv.toml`` of the machine's):
``index-url``, ``extra-index-url``, ``find-links``, ``constraint`` (for build environments too),
``no-index`` and ``trusted-host`` as uv's options of the same meaning, ``cert`` as
``SSL_CERT_FILE``, ``no-cache-dir`` as ``UV_NO_CACHE``; and ``--index-strategy unsafe-best-match``,
pip's rule (the best version across every index; uv's default stops at the first index that has
the name). A setting of pip's that is not one of these, nor one that changes nothing here
(:data:`NO_EFFECT`), makes this install use pip, said in one line.

**pip instead** where uv cannot be installed into the venv (``pip install uv``, from pip's own
indexes), where ``$WAN_S2V_INSTALLER`` is ``pip``, or as above. Both install the same versions
(``pip freeze`` of the two venvs compared, 2026-11-27). Exit status: the installer's.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

#: the uv that installs (into the venv itself, by pip)
UV_VERSION = "0.13.9"
#: pip settings that mean the same for uv as for pip, as uv options (each value split on spaces
#: where pip takes several)
AS_OPTION = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
#: pip settings without an effect on what is installed or from where
NO_EFFECT = {"default-timeout", "timeout", "disable-pip-version-check", "progress-bar", "no-color", "quiet",
             "verbose", "retries", "cache-dir", "root-user-action", "no-input", "use-feature", "config-file"}


def pip_settings(python: str) -> dict[str, str] | None:
    """pip's configuration, as ``pip config list`` prints it (``:env:`` variables over files;
    each value as pip prints it, a Python literal), or None when pip cannot say."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if out.returncode:
        return None
    by_section: dict[str, dict[str, str]] = {":env:": {}, "global": {}, "install": {}}
    for line in out.stdout.splitlines():
        m = re.fullmatch(r"(:env:|global|install)\.([\w-]+)=(.*)", line.strip())
        if m:
            try:
                by_section[m.group(1)][m.group(2)] = str(ast.literal_eval(m.group(3)))
            except (ValueError, SyntaxError):
                return None
    return {**by_section["global"], **by_section["install"], **by_section[":env:"]}  # pip's precedence


def _true(value: str) -> bool:
    """pip's reading of a switch's value (``PIP_NO_CACHE_DIR=1``, ``no-index = true``...)."""
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def uv_command(python: str, uv: str, settings: dict[str, str]) -> tuple[list[str], dict[str, str]] | str:
    """uv's command line and environment for pip's ``settings``, or why uv would differ."""
    argv = [uv, "pip", "install", "--no-config", "--python", python, "--index-strategy", "unsafe-best-match"]
    env = dict(os.environ)
    for key, value in settings.items():
        if key in AS_OPTION:
            for v in value.split():
                argv += [AS_OPTION[key], v]
                if key == "constraint":  # pip's constraints hold in its build environments too
                    argv += ["--build-constraint", v]
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key == "no-index":
            argv += ["--no-index"] if _true(value) else []
        elif key == "no-cache-dir":
            env.update({"UV_NO_CACHE": "1"} if _true(value) else {})
        elif key not in NO_EFFECT:
            return f"pip is configured with {key}={value!r}, which uv would not take the same"
    return argv, env


def main(args: list[str]) -> int:
    python = sys.executable
    bindir = Path(python).parent
    pip = [python, "-m", "pip", "install", "--no-compile", *args]
    why = None
    if os.environ.get("WAN_S2V_INSTALLER") == "pip":
        why = "$WAN_S2V_INSTALLER=pip"
    else:
        uv = bindir / "uv"
        if not uv.exists() and subprocess.run([python, "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"]).returncode:
            why = f"uv {UV_VERSION} could not be installed into the venv"
        else:
            settings = pip_settings(python)
            got = "pip could not list its configuration" if settings is None else uv_command(python, str(uv), settings)
            if isinstance(got, str):
                why = got
            else:
                argv, env = got
                print("venv_install: uv " + shlex.join(argv[3:] + args), flush=True)
                return subprocess.run(argv + args, env=env).returncode
    print(f"venv_install: pip ({why})", flush=True)
    return subprocess.run(pip).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
