"""Shared test fixtures: one tiny checkpoint + inputs per session, and a CLI runner.

Distributed tests spawn the real CLI (``python -m wan_s2v_runner run ...``) as a subprocess,
which spawns real ``torch.distributed.run`` processes over gloo. Nothing is mocked.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the job stores' exported contract (a package module): its checks' asserts show their values
pytest.register_assert_rewrite("wan_s2v_runner.serve.store.contract")

import torch  # noqa: E402
from fault_worker import fault_env  # noqa: E402

#: the spec's environment layer of ``strict_observers``
STRICT_ENV = "WAN_S2V_STRICT_OBSERVERS"

torch.set_num_threads(1)
#: an observer's error (the console, a server's keeper) fails the run it watches, in this process
#: and in every launcher a test starts: never logged and passed over in a test
os.environ[STRICT_ENV] = "1"
#: every process the suite starts inherits this mark (pytest-xdist's workers too: set once, by the
#: first process): at the end, a process that still carries it was left behind (:func:`leftovers`)
SESSION_ENV = "WAN_S2V_TEST_SESSION"
os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex)

#: for tests whose subject only exists with a CPU-only torch (the pinned CPU wheel with the CUDA
#: torchvision build, wan's import-time CUDA call): on a CUDA machine they skip, not fail
cpu_torch_only = pytest.mark.skipif(torch.version.cuda is not None or torch.cuda.is_available(),
                                    reason="needs the CPU-only torch build (this torch has CUDA)")

#: ranks without the engine (tests/stub_rank.py), for the tests whose subject is the launcher and
#: its supervisor: the real worker, process group, events, faults and mp4 writer
STUB_RANKS = {"WAN_S2V_RANK_WORKER": "tests.stub_rank"}

#: the tiny spec every distributed test shares (fast on 2 cores; 2 clips of 5 + 8 frames)
TINY_FLAGS = ["--device", "cpu", "--size", "64*64", "--infer-frames", "8", "--steps", "2",
              "--seed", "42", "--prompt", "a person talking"]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tiny checkpoint, reference image and speech audio (built once per session)."""
    from wan_s2v_runner.demo.assets import ensure_demo_assets

    return ensure_demo_assets(tmp_path_factory.mktemp("assets") / "demo")


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def load_tool(name: str):
    """``tools/NAME.py`` as a module (the tools are scripts, not a package: each imports its
    neighbours, such as ``lockfile``, by name)."""
    tools, path = str(ROOT / "tools"), ROOT / "tools" / f"{name}.py"
    got = sys.modules.get(name)
    if got is not None and getattr(got, "__file__", None) == str(path):
        return got
    sys.path.insert(0, tools)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # as an import would (dataclasses look their module up there)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(tools)


def cli_env(extra: dict | None = None) -> dict:
    """This environment, with the project first on PYTHONPATH (a child ``python -m
    wan_s2v_runner`` imports this checkout), and ``extra`` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def run_cli(args: list[str], *, cwd: Path, env: dict | None = None, timeout: float = 300) -> CliResult:
    """`python -m wan_s2v_runner ARGS` in cwd (argument list, no shell)."""
    full_env = cli_env(env)
    p = subprocess.run([sys.executable, "-m", "wan_s2v_runner", *args], cwd=cwd, env=full_env,
                       capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return CliResult(p.returncode, p.stdout, p.stderr)


def asset_flags(assets) -> list[str]:
    return ["--ckpt-dir", str(assets.ckpt_dir), "--image", str(assets.image), "--audio", str(assets.audio)]


def wait_for(fn, timeout: float, what: str, detail=lambda: ""):
    """fn()'s first truthy value, polled every 0.05 s; past the timeout an AssertionError naming
    what was awaited (and detail(), e.g. a server's log tail)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail()}".rstrip())


@contextlib.contextmanager
def cpu_engine(assets):
    """The engine imported and patched for an fp32 CPU run in this process (no process group):
    (wan, engine config, the tiny spec of TINY_FLAGS). The CPU device proxy is undone after."""
    from patches import apply_for_run
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.rank.worker import engine_config
    from wan_s2v_runner.shared.spec import RunSpec

    torch.set_num_threads(1)
    wan = import_wan()
    spec = RunSpec(ckpt_dir=assets.ckpt_dir, image=assets.image, audio=assets.audio,
                   prompt="a person talking", device="cpu", max_area=64 * 64, infer_frames=8, steps=2, seed=42)
    cfg = engine_config(wan, spec)
    apply_for_run(wan, spec, cfg.param_dtype)
    try:
        yield wan, cfg, spec
    finally:
        wan.speech2video.torch = torch  # undo the CPU device proxy for the tests that apply it themselves


@pytest.fixture(scope="module")
def engine_cpu(tiny_assets):
    """:func:`cpu_engine` for a test module."""
    with cpu_engine(tiny_assets) as engine:
        yield engine


def one_process_frames(engine_cpu, **updates) -> "torch.Tensor":
    """Our loop at one process, in this process, for the tiny spec with ``updates`` (the frames
    a ``--nproc 1`` run of the same flags writes: its worker runs this same loop)."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import engine_config, request_for
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    spec = spec.model_copy(update=updates)
    if "dtype" in updates:  # the compute dtype is the engine config's (worker.engine_config)
        cfg = engine_config(wan, spec)
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                            components.LoadSettings.of(spec))
    return JobShell(parts, plan).generate(request_for(spec))


def run_frames(assets, d: Path, flags: list[str], *extra: str) -> tuple["torch.Tensor", Path]:
    """`wan-s2v run` of ``flags`` in a new directory ``d`` (frames written with --frames-out):
    (the frames, the run directory). Fails the test when the run fails."""
    d.mkdir()
    r = run_cli(["run", *flags, *asset_flags(assets), "--output", str(d / "o.mp4"), "--frames-out",
                 str(d / "f.pt"), "--runs-root", str(d / "runs"), *extra], cwd=d)
    assert r.returncode == 0, r.output
    return torch.load(d / "f.pt"), next((d / "runs").glob("*"))


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory) -> dict:
    """The environment of one inductor cache for the compiling runs, shared by both xdist workers
    and kept from one test run to the next: ``{"TORCHINDUCTOR_CACHE_DIR": DIR}``, DIR =
    ``$XDG_CACHE_HOME`` (``~/.cache``) ``/wan-s2v/tests/inductor`` (apart from the user's own
    ``--compile`` cache). Each run still compiles (dynamo traces its blocks, the ``compile`` stage is
    timed); what a later run stops paying is the C++ build of kernels built before, as a user's
    second run does (the runner's cache is per user and node: wan_s2v_runner/shared/inductor.py).
    Inductor keys each kernel by its graph, its configuration and torch's version, so a change to
    the code compiles anew; no test's verdict depends on what the cache holds. A path with spaces
    (which preflight refuses) falls back to this test run's temporary directory."""
    from wan_s2v_runner.shared.inductor import cache_dir, cpp_build_refuses

    user_cache = cache_dir({k: v for k, v in os.environ.items() if k == "XDG_CACHE_HOME"})  # .../wan-s2v/inductor
    base = user_cache.parent / "tests" / "inductor"
    d = base if cpp_build_refuses(base) is None else session_root(tmp_path_factory) / "inductor-cache"
    d.mkdir(parents=True, exist_ok=True)
    return {"TORCHINDUCTOR_CACHE_DIR": str(d)}


def session_root(tmp_path_factory) -> Path:
    """The directory every xdist worker of this test run shares (the base of their temp dirs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory, name: str, make):
    """``make()``'s result (anything ``torch.save`` keeps), made once per test run however many
    xdist workers ask: the first makes it under a file lock and saves it, the others wait on the
    lock and load it (what a session fixture is per worker, shared across workers)."""
    import fcntl

    root = session_root(tmp_path_factory)
    path = root / f"once-{name}.pt"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_suffix(".partial")
            torch.save(make(), tmp)
            os.replace(tmp, path)
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="session")
def reference_frames(tiny_assets, tmp_path_factory):
    """One process's frames for the shared tiny spec (TINY_FLAGS), computed in this process by the
    loop a ``--nproc 1`` run's worker runs: what every parallel layout must equal (once per test
    run: :func:`once_per_run`)."""
    def make():
        with cpu_engine(tiny_assets) as engine:
            return one_process_frames(engine)
    return once_per_run(tmp_path_factory, "reference_frames", make)


#: a second job's spec over the tiny one (another seed, size, prompt and solver): test_batch's and
#: test_serve's, whose one-process frames :func:`big_reference_frames` makes once
BIG_JOB = dict(seed=7, max_area=128 * 128, prompt="someone else", solver="dpm++")
#: step caching's setting the tests use (8 steps: 2 leave nothing to reuse)
CACHE = "easycache:0.05"


@pytest.fixture(scope="session")
def big_reference_frames(tiny_assets, tmp_path_factory):
    """One process's frames for :data:`BIG_JOB` (once per test run)."""
    def make():
        with cpu_engine(tiny_assets) as engine:
            return one_process_frames(engine, **BIG_JOB)
    return once_per_run(tmp_path_factory, "big_reference_frames", make)


def one_process_cached(engine_cpu, **updates):
    """Our loop at one process, in this process (what a --nproc 1 worker runs), for the tiny spec
    with ``updates``: the frames and the step cache's per-clip records."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.job_shell import JobShell
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    spec = spec.model_copy(update=updates)
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0,
                            components.LoadSettings(dit_quant=spec.dit_quant, fp8_matmul=spec.fp8_matmul))
    shell = JobShell(parts, plan)
    return shell.generate(request_for(spec)), shell.driver.cache_records


@pytest.fixture(scope="session")
def cached_reference(tiny_assets, tmp_path_factory):
    """One process's frames and step-cache records for the tiny spec at 8 steps with ``--cache CACHE``
    (once per test run)."""
    def make():
        with cpu_engine(tiny_assets) as engine:
            return one_process_cached(engine, steps=8, cache=CACHE)
    return once_per_run(tmp_path_factory, "cached_reference", make)


@pytest.fixture(scope="session")
def held_job_mp4(tiny_assets, tmp_path_factory) -> str:
    """sha256 of the mp4 one process makes for ``serving.HELD_JOB`` (the 3-clip job the shared
    queue's killed server and the fleet's frozen one hold at clip 2): what the server that
    finishes it must have made, computed once per test run (:func:`once_per_run`)."""
    from serving import HELD_JOB, expected_mp4

    def make():
        d = tmp_path_factory.mktemp("held-job")
        with cpu_engine(tiny_assets) as engine:
            return expected_mp4(engine, tiny_assets.audio, d / "want.mp4", **{k: int(v) for k, v in HELD_JOB.items()})
    return once_per_run(tmp_path_factory, "held_job_mp4", make)


@pytest.fixture(scope="session")
def pose_reference_frames(tiny_assets, tmp_path_factory):
    """One process's frames for the shared tiny spec with the demo's pose video (``--pose-video``;
    15 of the 16 pose frames of 2 clips, the last padded): what the layouts run with it must equal."""
    def make():
        with cpu_engine(tiny_assets) as engine:
            return one_process_frames(engine, pose_video=tiny_assets.pose_video)
    return once_per_run(tmp_path_factory, "pose_reference_frames", make)


@dataclass
class SharedRun:
    """A spawned run several tests assert on (see :func:`hybrid_run`)."""

    dir: Path  # its cwd; run directory under runs/
    result: CliResult
    output: Path
    frames: Path
    other_dir: Path  # the run started at the same moment
    other_result: CliResult

    @property
    def run_dir(self) -> Path:
        return next((self.dir / "runs").glob("*-*"))


@pytest.fixture(scope="session")
def hybrid_run(tiny_assets, tmp_path_factory) -> SharedRun:
    """One 2-rank ``hybrid`` run of the shared tiny spec (``--load-waves 2``, the demo's pose video,
    an output name with a space and a quote), spawned once per session for the tests that read it: parity (frames, lean
    loading: tests/test_parity.py) and supervision (run.json, console, rendezvous ports:
    tests/test_supervision.py). A second 2-rank run starts at the same moment (neither names a
    --master-port, so each rendezvous binds a port the OS picks): the shared tiny spec in
    ``ulysses`` with ``--preview``, whose videos so far tests/test_preview.py reads."""
    d, other = tmp_path_factory.mktemp("hybrid"), tmp_path_factory.mktemp("hybrid_other")
    common = [*TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--watchdog-load", "90"]
    env = cli_env()
    second = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "run", *common, "--preview",
                               "--output", str(other / "out" / "o.mp4"), "--frames-out", str(other / "f.pt"),
                               "--runs-root", str(other / "runs")], cwd=other, env=env, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        output = d / "out with space's.mp4"
        r = run_cli(
            [
                "run",
                *common,
                "--mode",
                "hybrid",
                "--load-waves",
                "2",
                "--pose-video",
                str(tiny_assets.pose_video),
                "--output",
                str(output),
                "--frames-out",
                str(d / "out.pt"),
                "--runs-root",
                str(d / "runs"),
            ],
            cwd=d,
        )
        out, err = second.communicate(timeout=300)
    finally:
        second.kill()
    return SharedRun(d, r, output, d / "out.pt", other, CliResult(second.returncode, out, err))


@pytest.fixture(scope="session", autouse=True)
def warm_agent(request, tmp_path_factory):
    """One node warm agent (``wan-s2v warm``) per xdist worker, named to every launch this worker
    makes (``$WAN_S2V_WARM_AGENT``): each run forks its node agent from it instead of importing
    torch and the engine anew (~4.4 CPU-s a launch), as a user's runs do on a node that keeps one.
    A test of the spawned agent itself takes :func:`spawned_agent` (the demo in CI's ``.ci/run``
    spawns too); tests/test_warm_agent.py starts its own."""
    from wan_s2v_runner.shared import warm_agent as wire

    if not any(item.get_closest_marker("slow") for item in request.session.items):
        yield None  # no launch of the engine to come (make test-fast): not worth its imports
        return
    sock = tmp_path_factory.mktemp("warm") / "warm.sock"
    log = open(sock.with_name("warm.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "warm", "--socket", str(sock)],
                            env=cli_env({wire.ENV: wire.OFF}), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or b"ready on" in sock.with_name("warm.log").read_bytes(), 120,
                 "the warm agent", lambda: sock.with_name("warm.log").read_text(errors="replace"))
        assert proc.poll() is None, sock.with_name("warm.log").read_text(errors="replace")
        os.environ[wire.ENV] = str(sock)
        yield sock
    finally:
        os.environ.pop(wire.ENV, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def spawned_agent(monkeypatch):
    """This test's launches spawn their node agent (``$WAN_S2V_WARM_AGENT=off``): its subject is
    the agent as a child of the launcher (its process tree, its signals)."""
    from wan_s2v_runner.shared import warm_agent as wire

    monkeypatch.setenv(wire.ENV, wire.OFF)


@pytest.fixture(scope="session")
def cluster():
    """A throwaway PostgreSQL cluster (tests/pg_cluster.py), one per xdist worker, each test its
    own database (``cluster.database()``); skipped, with the reason, only where none can run. A
    test that restarts or stops it (test_fleet's outage) leaves it running again."""
    import pg_cluster

    c = pg_cluster.start()
    if isinstance(c, str):
        pytest.skip(c)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def inputs(tiny_assets, tmp_path_factory):
    """The allowed root with the tiny inputs in it, a file outside it and a symlink escaping it."""
    allowed = tmp_path_factory.mktemp("allowed inputs")
    for name in ("image", "audio"):
        src = getattr(tiny_assets, name)
        (allowed / src.name).write_bytes(src.read_bytes())
    outside = tmp_path_factory.mktemp("outside") / "speech.wav"
    outside.write_bytes(tiny_assets.audio.read_bytes())
    (allowed / "escape.wav").symlink_to(outside)
    return {"root": allowed, "image": allowed / tiny_assets.image.name, "audio": allowed / tiny_assets.audio.name,
            "outside": outside, "escape": allowed / "escape.wav"}


@pytest.fixture(scope="session")
def server(tiny_assets, inputs, tmp_path_factory):
    """One ``wan-s2v serve`` (2 ranks, ulysses, the DiT streamed block by block from the node's
    shared host copy, a token, ``inputs`` allowed) for the session: the serve, page and client
    tests take it in turn, the way a server lives. Its jobs' videos are compared with one resident
    process's: a served group streams for every job and makes the same frames."""
    from serving import BOOM, HELD, MIDWAY, NO_SPACE, POISON, SERVER_FLAGS, TOKEN, ServerProcess

    d = tmp_path_factory.mktemp("serve") / "server dir"
    flags = [*SERVER_FLAGS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--token", TOKEN,
             "--allow-dir", str(inputs["root"]), "--max-queue", "6", "--max-upload-mb", "1", "--dit-offload", "blocks"]
    s = ServerProcess(d, flags, env=fault_env(f"{POISON},{NO_SPACE},{MIDWAY},{HELD},{BOOM}"))
    yield s
    assert s.stop() == [] and "serve: stopping the rank group" in s.text()  # SIGTERM leaves nothing running


@pytest.fixture(scope="session")
def live_server(tiny_assets, inputs, tmp_path_factory):
    """``wan-s2v serve --mode live --nproc 1`` (a token, ``inputs`` allowed), its group loaded: the
    sessions' WebRTC viewers, the page's session panel and the voice-agent plugins take it in turn."""
    from serving import TINY_DEFAULTS, TOKEN, ServerProcess

    s = ServerProcess(tmp_path_factory.mktemp("live") / "server", [
        *TINY_DEFAULTS, "--mode", "live", "--nproc", "1", "--ckpt-dir", str(tiny_assets.ckpt_dir), "--token", TOKEN,
        "--allow-dir", str(inputs["root"])])
    wait_for(lambda: s.http.get("/health").json()["group"] == "idle", 180, "the live group to load", s.tail)
    yield s
    assert s.stop() == []


# ----- parallel runs (pytest-xdist, ``-n 2 --dist loadgroup``: pyproject's addopts) -----
#: the session fixtures one group of tests shares: a test that uses one runs on the worker that
#: holds it (built once, not once per worker)
SHARED_GROUPS = ("server", "hybrid_run", "live_server")


def _module_bound(item) -> bool:
    """Whether the test uses a fixture made once per module (or class): its module's tests then
    run on one worker, so that fixture is made once."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return True
    return any(defs and defs[-1].scope in ("module", "class", "package") for defs in info.name2fixturedefs.values())


def _group(item) -> str:
    """The xdist group of a test: its marker's; a session fixture's of :data:`SHARED_GROUPS`;
    a slow test that shares no module fixture is a group of its own (the two workers share a
    file's long tests between them); any other test its module's."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0])
    shared = next((name for name in SHARED_GROUPS if name in getattr(item, "fixturenames", ())), None)
    if shared:
        return shared
    if item.get_closest_marker("slow") is not None and not _module_bound(item):
        return item.nodeid
    return item.module.__name__


#: what a slow test is taken to cost when it does not say (``@pytest.mark.slow(seconds=N)``)
SLOW_S = 10
#: each test's seconds as last measured (``tools/suite_table --write-durations``); a test not in it
#: is taken at its marker's word
DURATIONS = Path(__file__).with_name("durations.json")


def _recorded() -> dict:
    try:
        import json

        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def _seconds(item, recorded: dict) -> float:
    """A test's expected seconds, for ordering the groups: as measured last (``recorded``), else 0
    unless slow; a slow test's own ``seconds`` (one that takes far longer than most), else
    :data:`SLOW_S`."""
    if item.nodeid in recorded:
        return recorded[item.nodeid]
    marker = item.get_closest_marker("slow")
    return 0 if marker is None else marker.kwargs.get("seconds", SLOW_S)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Each test file is one group (its module fixtures are built once), except that the tests
    that share a session fixture of :data:`SHARED_GROUPS` are one group across files. The groups
    expected to take longest (:func:`_seconds`) go first (the workers are handed groups in this
    order: the longest first, so neither waits alone at the end); within a group the order is the
    files'."""
    groups = {}
    for item in items:
        name = _group(item)
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(name))
        groups.setdefault(name, []).append(item)
    recorded = _recorded()
    weight = {name: sum(_seconds(i, recorded) for i in group) for name, group in groups.items()}
    order = sorted(groups, key=lambda name: -weight[name])  # stable: ties keep the collection order
    items[:] = [item for name in order for item in groups[name]]


# ----- nothing left behind -----
def leftovers(mark: str, root: Path) -> dict[int, str]:
    """Processes other than this one whose environment carries ``mark``, or whose command line
    names a path under the session's temporary ``root`` (pid -> command line): a warm agent and
    what it forks carry no environment there (setproctitle takes that memory for the title)."""
    needle = f"{SESSION_ENV}={mark}".encode()
    under = str(root).encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") or under in (d / "cmdline").read_bytes():
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The suite fails when a process it started outlives it (a left-over rank, torchrun, server or
    browser costs every later run CPU and /proc scans: the suite's time grew run to run); they are
    killed. pytest-xdist's workers check nothing: their controller does, after they are gone."""
    if hasattr(session.config, "workerinput"):
        return
    mark = os.environ[SESSION_ENV]
    root = session.config._tmp_path_factory.getbasetemp()
    deadline = time.time() + 10.0  # the last fixtures' processes may still be exiting
    while leftovers(mark, root) and time.time() < deadline:
        time.sleep(0.2)
    left = leftovers(mark, root)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        print(f"\nERROR: the test session left {len(left)} process(es) running (killed now):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED



@pytest.fixture(scope="module")
def audio_wan():
    """The engine's modules, its speech read as every run reads it (our ``audio_load`` patch)."""
    from patches import audio_load
    from wan_s2v_runner.loading.engine import import_wan

    w = import_wan()
    applied = audio_load.apply(w)
    yield w
    if applied:
        audio_load.restore(w)


@pytest.fixture(scope="module")
def tiny_w2v(audio_wan, tmp_path_factory):
    """The demo checkpoint's tiny wav2vec2 (xlsr-53's layout: the layer-norm conv encoder with the real
    strides, the 128-frame positional conv, 25 hidden states; 32 wide), loaded by upstream's
    ``AudioEncoder``."""
    from wan_s2v_runner.demo.tiny_checkpoint import _write_wav2vec
    from wan_s2v_runner.shared.ckpt_layout import WAV2VEC_DIR

    ckpt = tmp_path_factory.mktemp("w2v")
    _write_wav2vec(ckpt, audio_wan, seed=4, hidden=32)
    enc = audio_wan.modules.s2v.audio_encoder.AudioEncoder(model_id=str(ckpt / WAV2VEC_DIR))
    assert enc.model.config.feat_extract_norm == "layer" and enc.model.config.num_conv_pos_embeddings == 128
    return enc


def encode_audio_shell(wan, encoder, param_dtype):
    """What upstream's ``WanS2V.encode_audio`` reads of a ``WanS2V`` (its own function, unbound), on the CPU."""
    import torch

    cls = type("S2V", (), {"encode_audio": wan.speech2video.WanS2V.encode_audio})
    s = cls()
    s.audio_encoder, s.fps, s.audio_sample_m = encoder, 16, 0
    s.device, s.param_dtype = torch.device("cpu"), param_dtype
    return s
