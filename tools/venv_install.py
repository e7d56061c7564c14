"""Install ``requirements.lock`` into the venv whose Python runs this script: the files pip picks,
hash-checked against the lock, installed by uv where uv can be had, by pip otherwise. (Makefile
helper: the set-up's installs; standard library only.)

    .venv/bin/python tools/venv_install.py          # what this machine needs of the lock
    .venv/bin/python tools/venv_install.py -e .     # the project itself (no deps, no build isolation)

**Steps.**

1. *The tools.* The venv's own pip installs the lock's pip and uv (``--require-hashes``).
2. *pip decides the files.* ``pip install --dry-run --no-deps --report`` over the lock (hashes set
   aside: the lock names versions, pip names files) says, for every entry whose markers hold here,
   which file pip takes with this machine's configuration (its indexes, find-links, constraints)
   and what that file declares (``Requires-Dist``). pip's rule is the best file across *every*
   index; uv's (``--index-strategy unsafe-best-match``) is the best version across indexes but,
   for that version, only the first index's files. On a machine whose first extra index held only
   soundfile's generic ``py2.py3-none-any`` wheel (no libsndfile inside) and a later one its
   manylinux wheel (libsndfile inside), uv took the generic one and ``import soundfile`` failed on
   a fresh machine; so uv no longer chooses files.
3. *What is needed here* (:func:`lockfile.needed`): the lock's ``# via`` graph from the requirement
   files, following an edge only where the chosen file declares it (a CPU build of torch declares
   none of the CUDA build's ``nvidia-*`` packages, so they are not installed).
4. *Each file's sha256 must be one the lock lists for its version*, else nothing is installed and
   one line names the file and the fix.
5. *Install exactly those files*, each by its URL and hash (``--no-deps --require-hashes``): by uv,
   or by pip where ``$WAN_S2V_INSTALLER`` is ``pip`` or uv could not be installed. (Given
   ``torch==2.13.0`` and the lock's hashes, pip in hash-checking mode took PyPI's CUDA build where
   its dry run had picked the CPU build, so neither installer is given a version to choose from.)

Exit status: 0, 1 (a chosen file not in the lock or without a hash, or pip could not decide), or
the installer's.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import lockfile  # tools/, beside this script

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
#: the set-up's own tools: installed first, by the venv's pip, from the lock
TOOLS = ("pip", "uv")


def pip_settings(python: str) -> dict:
    """pip's configuration, as ``pip config list`` prints it (``:env:`` variables over the install
    section over the global one; each value as pip prints it, a Python literal); {} when pip
    cannot say."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    by_section: dict = {":env:": {}, "global": {}, "install": {}}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        m = re.fullmatch(r"(:env:|global|install)\.([\w-]+)=(.*)", line.strip())
        if m:
            try:
                by_section[m.group(1)][m.group(2)] = str(ast.literal_eval(m.group(3)))
            except (ValueError, SyntaxError):
                continue
    return {**by_section["global"], **by_section["install"], **by_section[":env:"]}  # pip's precedence


def _true(value: str) -> bool:
    """pip's reading of a switch's value (``PIP_NO_CACHE_DIR=1``, ``no-cache-dir = true``...)."""
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def uv_command(python: str, uv: str, settings: dict) -> tuple:
    """uv's ``pip install`` command line and environment. uv is given files by URL, so of pip's
    settings only those that reach a URL matter: ``cert`` (as ``SSL_CERT_FILE``), ``trusted-host``,
    ``no-cache-dir`` (as ``UV_NO_CACHE``); no configuration of uv's own is read (``--no-config``)."""
    argv = [uv, "pip", "install", "--no-config", "--python", python]
    env = dict(os.environ)
    for host in settings.get("trusted-host", "").split():
        argv += ["--allow-insecure-host", host]
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    if _true(settings.get("no-cache-dir", "")):
        env["UV_NO_CACHE"] = "1"
    return argv, env


def requirements_text(entries, hashes_of=None) -> str:
    """A pip requirements file of lock entries, ``hashes_of(entry)`` (default: all the lock's)."""
    lines = []
    for e in entries:
        marker = f" ; {e.marker}" if e.marker else ""
        hashes = sorted(hashes_of(e) if hashes_of else e.hashes)
        lines.append(f"{e.name}=={e.version}{marker}" + "".join(f" --hash={h}" for h in hashes))
    return "\n".join(lines) + "\n"


def pip_install(python: str, text: str, *args: str) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        return subprocess.run([python, "-m", "pip", "install", "--no-compile", "--no-deps", "--require-hashes",
                               "--disable-pip-version-check", *args, "-r", f.name]).returncode
    finally:
        os.unlink(f.name)


def decide(python: str, entries) -> dict:
    """pip's choice for every entry whose markers hold here: name -> its report item (``metadata``
    with ``version`` and ``requires_dist``, ``download_info`` with ``url`` and ``archive_info``)."""
    with tempfile.TemporaryDirectory() as tmp:
        req, report = Path(tmp, "lock.txt"), Path(tmp, "report.json")
        req.write_text(requirements_text(entries, hashes_of=lambda e: ()), encoding="utf-8")
        proc = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                               "--quiet", "--disable-pip-version-check", "--report", str(report), "-r", str(req)],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            sys.exit("venv_install: pip could not pick a file for every locked package (above); fix: the "
                     "machine's indexes must serve the locked versions (pip config list)")
        items = json.loads(report.read_text(encoding="utf-8"))["install"]
    return {lockfile.canonical(i["metadata"]["name"]): i for i in items}


def file_hash(item: dict):
    """The chosen file's ``sha256:<hex>`` as the index gave it, or None."""
    got = (item["download_info"].get("archive_info") or {}).get("hashes", {}).get("sha256")
    return f"sha256:{got}" if got else None


def file_name(item: dict) -> str:
    return item["download_info"]["url"].rsplit("/", 1)[-1].replace("%2B", "+")


def check_hashes(chosen: dict, names, by_version: dict) -> list:
    """One line for each chosen file whose sha256 the lock does not list for its version."""
    bad = []
    for name in sorted(names):
        item = chosen[name]
        version = item["metadata"]["version"]
        listed = by_version.get((name, lockfile.public(version)), set())
        h = file_hash(item)
        if h is not None and h not in listed:
            bad.append(f"venv_install: {name} {version}: pip picked {file_name(item)} ({h}), which "
                       f"requirements.lock does not list for {name}=={lockfile.public(version)}; fix: if you "
                       f"trust that build, add its hash to EXTRA_BUILDS in tools/lock.py and run make lock")
    return bad


def install_lock(python: str) -> int:
    entries = lockfile.parse(LOCK.read_text(encoding="utf-8"))
    tools = [e for e in entries if e.name in TOOLS and e.marker is None]
    use_pip = "$WAN_S2V_INSTALLER=pip" if os.environ.get("WAN_S2V_INSTALLER") == "pip" else None
    # 1. the tools: the lock's pip (it decides), then its uv (it installs)
    rc = pip_install(python, requirements_text([e for e in tools if e.name == "pip"]), "--quiet")
    if rc:
        return rc
    uv = Path(python).parent / "uv"
    if use_pip is None and pip_install(python, requirements_text([e for e in tools if e.name == "uv"]), "--quiet"):
        use_pip = "the locked uv could not be installed into the venv"
    # 2. pip decides the files; 3. what this machine needs of them
    chosen = decide(python, entries)
    requires = {name: item["metadata"].get("requires_dist") or [] for name, item in chosen.items()}
    need = lockfile.needed(requires, entries) - set(TOOLS)
    left = sorted(set(chosen) - need - set(TOOLS))
    if left:
        print(f"venv_install: not needed with the files chosen here: {', '.join(left)}", flush=True)
    # 4. every file is one the lock lists
    by_version: dict = {}
    for e in entries:
        by_version.setdefault((e.name, e.version), set()).update(e.hashes)
    bad = check_hashes(chosen, need, by_version)
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    nohash = sorted(n for n in need if file_hash(chosen[n]) is None)
    if nohash:
        print(f"venv_install: the index gave no hash for the files pip picked for {', '.join(nohash)}: they cannot "
              "be checked against requirements.lock; fix: an index that serves hashes (PyPI does)", file=sys.stderr)
        return 1
    # 5. install exactly those files, by URL and hash
    lines = [f"{n} @ {chosen[n]['download_info']['url']} --hash={file_hash(chosen[n])}" for n in sorted(need)]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        if use_pip is None:
            argv, env = uv_command(python, str(uv), pip_settings(python))
            print(f"venv_install: uv installs the {len(need)} files pip picked", flush=True)
            return subprocess.run(argv + ["--no-deps", "--require-hashes", "-r", f.name], env=env).returncode
        print(f"venv_install: pip installs the {len(need)} files it picked ({use_pip})", flush=True)
        return subprocess.run([python, "-m", "pip", "install", "--no-compile", "--no-deps", "--require-hashes",
                               "--disable-pip-version-check", "-r", f.name]).returncode
    finally:
        os.unlink(f.name)


def install_editable(python: str, path: str) -> int:
    """The project, without its dependencies (the lock's) and without build isolation (the
    locked setuptools builds it: an isolated build would fetch the newest)."""
    uv = Path(python).parent / "uv"
    if os.environ.get("WAN_S2V_INSTALLER") != "pip" and uv.exists():
        argv, env = uv_command(python, str(uv), pip_settings(python))
        return subprocess.run(argv + ["--no-deps", "--no-build-isolation", "-e", path], env=env).returncode
    return subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-compile", "--no-deps",
                           "--no-build-isolation", "-e", path]).returncode


def main(args: list) -> int:
    if args[:1] == ["-e"] and len(args) == 2:
        return install_editable(sys.executable, args[1])
    if args:
        sys.exit("usage: tools/venv_install.py [-e PATH]")
    return install_lock(sys.executable)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
