"""The house's import rules, read from the sources (every import counts, including the lazy ones
inside functions): no cycle; each folder imports only the folders its ``__init__`` docstring lists
on its ``May import:`` line (so the launcher never reaches rank code and the rank side never
reaches the console); the vocabulary modules import nothing from the project; and the launcher
starts without importing torch."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wan_s2v_runner", "runners", "patches")


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        is_pkg = f.name == "__init__.py"
        base = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    src = f"{anchor}.{node.module}" if node.module else anchor
                else:
                    src = node.module or ""
                # "from pkg import sub" imports the submodule when there is one
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                while t and t not in mods:  # "a.b.name" -> the module that defines it
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def area_of(mod: str) -> str:
    """The folder a module lives in: ``runners``, ``patches``, or a folder of ``wan_s2v_runner``
    (its ``__init__``/``__main__`` are the package's own: ``wan_s2v_runner``)."""
    parts = mod.split(".")
    if parts[0] != "wan_s2v_runner":
        return parts[0]
    return parts[1] if len(parts) > 1 and (ROOT / "wan_s2v_runner" / parts[1]).is_dir() else "wan_s2v_runner"


def allowed_imports() -> dict[str, set[str]]:
    """{folder: the folders it may import}, from each folder's ``May import:`` docstring line."""
    out = {"wan_s2v_runner": {"cli"}}  # ``python -m wan_s2v_runner`` is the command line
    folders = [ROOT / "runners", ROOT / "patches"] + sorted(
        d for d in (ROOT / "wan_s2v_runner").iterdir() if (d / "__init__.py").is_file())
    for d in folders:
        doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text(encoding="utf-8"))) or ""
        m = re.search(r"^May import: (.*?)\.?$", doc, re.M)
        assert m, f"{d.relative_to(ROOT)}/__init__.py: its docstring has no 'May import:' line"
        words = re.sub(r"\(.*?\)", "", m.group(1))
        out[d.name] = set() if words.startswith("nothing") else {w.strip() for w in words.split(",")}
    return out


def violations(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        here = area_of(mod)
        for dep in sorted(deps):
            there = area_of(dep)
            if there != here and there not in allowed[here]:
                bad.append(f"{mod} ({here}/) imports {dep} ({there}/), not in its May import: line")
    return bad


def test_graph_is_read_from_the_sources():
    g = import_graph()
    assert "wan_s2v_runner.shared.spec" in g["wan_s2v_runner.cli.main"]  # sanity: edges are found
    assert "wan_s2v_runner.preflight.checks_parallel" in g["wan_s2v_runner.preflight.registry"]
    assert "wan_s2v_runner.loading.engine" in g["wan_s2v_runner.rank.worker"]  # "from pkg import mod"


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_every_module_lives_in_a_folder():
    flat = sorted(f.name for f in (ROOT / "wan_s2v_runner").glob("*.py")
                  if f.name not in ("__init__.py", "__main__.py"))
    assert not flat, f"modules outside the folders by role: {flat} (see wan_s2v_runner/__init__.py)"


def test_folders_import_only_what_their_docstring_allows():
    allowed = allowed_imports()
    assert allowed["shared"] == set()
    assert "launcher" not in allowed["rank"] and "rank" not in allowed["launcher"]
    assert "serve" not in allowed["launcher"]  # the server drives the launcher, never the other way
    assert "rank" not in allowed["serve"]  # ... and reaches its ranks only through the launcher
    assert "rank" not in allowed["runners"]  # a mode's runner is given the rank's plan: no arrow back up
    assert "loading" not in allowed["patches"]  # the loader uses patches; what a patch needs of it is given
    assert set(allowed) >= {"cli", "launcher", "serve", "rank", "loading", "vae_split", "shared", "demo",
                            "preflight", "runners", "patches"}
    bad = violations(import_graph(), allowed)
    assert not bad, "\n".join(bad)


def test_the_server_reaches_its_rank_groups_only_through_the_group_door():
    """Inside ``serve/``, only the door to a rank group (``serve/group.py``: ``GroupClient`` and its
    one implementation) runs the launcher's launches or writes a group's inbox; the keeper and
    everything else go through it."""
    g = import_graph()
    launches = sorted(m for m, deps in g.items() if area_of(m) == "serve" and "wan_s2v_runner.launcher.launch" in deps)
    assert launches == ["wan_s2v_runner.serve.group"], launches
    writes = re.compile(r"\binbox\.(post_job|cancel|write_lease|drop_lease|stop)\(")
    writers = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "wan_s2v_runner" / "serve").rglob("*.py")
                     if writes.search(f.read_text(encoding="utf-8")))
    assert writers == ["wan_s2v_runner/serve/group.py"], writers


def test_a_rank_takes_its_jobs_only_from_its_job_source():
    """On the rank side, only the job sources (``rank/job_sources.py``) read the server's inbox or
    the launcher's jobs list, and the lease (``rank/lease.py``) reads its lease files: the group's
    loop asks its source, never the run directory's files, where its jobs come from."""
    g = import_graph()
    readers = sorted(m for m, deps in g.items() if area_of(m) == "rank"
                     and deps & {"wan_s2v_runner.shared.inbox", "wan_s2v_runner.shared.jobs"}
                     and m != "wan_s2v_runner.rank.worker")
    assert readers == ["wan_s2v_runner.rank.job_sources", "wan_s2v_runner.rank.lease"], readers
    worker = (ROOT / "wan_s2v_runner" / "rank" / "worker.py").read_text(encoding="utf-8")
    assert "wan_s2v_runner.shared.inbox" not in g["wan_s2v_runner.rank.worker"]
    assert not re.search(r"\bread_jobs\b|inbox_of", worker)


def test_the_rule_catches_a_rank_module_importing_the_console():
    graph = {"wan_s2v_runner.rank.worker": {"wan_s2v_runner.launcher.console"},
             "wan_s2v_runner.launcher.console": set()}
    assert violations(graph, allowed_imports()) == [
        "wan_s2v_runner.rank.worker (rank/) imports wan_s2v_runner.launcher.console (launcher/), "
        "not in its May import: line"]


def test_vocabularies_import_nothing_from_the_project():
    g = import_graph()
    for leaf in ("wan_s2v_runner.shared.layout", "wan_s2v_runner.shared.stages", "wan_s2v_runner.shared.exit_codes"):
        assert g[leaf] == set(), (leaf, g[leaf])


def test_the_launcher_starts_without_torch():
    """``wan-s2v`` parses its flags and prints help in a fresh interpreter without importing torch
    (nor the engine, nor the rank side): start-up stays fast, and preflight refuses before any
    heavy import."""
    code = ("import sys, contextlib, io\n"
            "from wan_s2v_runner.cli import main as cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        cli.main(['run', '--help'])\n"
            "    except SystemExit:\n        pass\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'wan', 'runners')\n"
            "               or m.startswith(('wan_s2v_runner.rank', 'wan_s2v_runner.vae_split')))\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_refused_run_starts_no_process_and_imports_no_torch(tmp_path):
    """On a machine where no CUDA can be present (this CPU-only build), ``wan-s2v run``'s checks
    come before its agent: a run preflight refuses starts no other process (every Python
    interpreter started under the test's ``sitecustomize`` logs its command line, and whether it
    imported torch, as it exits), and the launcher reads the machine and the checkpoint without
    importing torch."""
    from wan_s2v_runner.preflight.probe import probes_quickly

    assert probes_quickly()  # the CPU-only build this suite runs on
    log, hook = tmp_path / "starts.log", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # a line as it starts (a killed one too), one more as it exits
        "import atexit, sys\n"
        "cmd = open('/proc/self/cmdline', 'rb').read().replace(b'\\0', b' ').decode().strip()\n"
        "def _log(what):\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(f\"{what} {cmd}\\n\")\n"
        "_log('start')\n"
        "atexit.register(lambda: _log(f\"exit torch={'torch' in sys.modules}\"))\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{hook}:{ROOT}"}
    # the hook sees a child's start too (control: one interpreter starting another logs two lines)
    subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'])"],
                   env=env, check=True, timeout=60)
    assert [line.split()[0] for line in log.read_text().splitlines()].count("start") == 2, log.read_text()
    log.unlink()

    # the venv check's verdict is kept in the venv (a venv changed since it was last checked is
    # checked here, once, not under the hook): the run's preflight reads it, starting nothing
    from wan_s2v_runner.loading import venv_check
    assert venv_check.cached_verdict() is not None

    from wan_s2v_runner.demo.assets import ensure_demo_assets
    assets = ensure_demo_assets(tmp_path / "assets")
    r = subprocess.run([sys.executable, "-m", "wan_s2v_runner", "run", "--device", "cpu", "--size", "64*64",
                        "--ckpt-dir", str(assets.ckpt_dir), "--image", str(tmp_path / "no-such.png"),
                        "--audio", str(assets.audio), "--prompt", "a person talking", "--nproc", "2",
                        "--output", str(tmp_path / "out.mp4"), "--runs-root", str(tmp_path / "runs")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stdout + r.stderr  # exit_codes.PREFLIGHT
    assert "--image" in r.stdout + r.stderr
    lines = log.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start ")]
    assert len(starts) == 1 and "wan_s2v_runner run" in starts[0], lines
    assert any(line.startswith("exit torch=False ") for line in lines), lines  # the launcher never imported torch
    assert not (tmp_path / "runs").exists()  # nothing made, nothing to clean up
