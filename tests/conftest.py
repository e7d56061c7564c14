"""Shared test fixtures: one tiny checkpoint + inputs per session, and a CLI runner.

Distributed tests spawn the real CLI (``python -m wan_s2v_runner run ...``) as a subprocess,
which spawns real ``torch.distributed.run`` processes over gloo. Nothing is mocked.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from wan_s2v_runner.launcher.observer import STRICT_ENV  # noqa: E402

torch.set_num_threads(1)
#: an observer's error (the console, a server's keeper) fails the run it watches, in this process
#: and in every launcher a test starts: never logged and passed over in a test
os.environ[STRICT_ENV] = "1"

#: for tests whose subject only exists with a CPU-only torch (the pinned CPU wheel with the CUDA
#: torchvision build, wan's import-time CUDA call): on a CUDA machine they skip, not fail
cpu_torch_only = pytest.mark.skipif(torch.version.cuda is not None or torch.cuda.is_available(),
                                    reason="needs the CPU-only torch build (this torch has CUDA)")

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
    from wan_s2v_runner.rank.generation import S2VGenerator
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.rank.worker import request_for
    from wan_s2v_runner.shared.layout import Layout, Mode

    wan, cfg, spec = engine_cpu
    spec = spec.model_copy(update=updates)
    plan = RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0)
    parts = components.load(wan, cfg, str(spec.ckpt_dir), plan, torch.device("cpu"), 0)
    return S2VGenerator(parts, plan).generate(request_for(spec))


def run_frames(assets, d: Path, flags: list[str], *extra: str) -> tuple["torch.Tensor", Path]:
    """`wan-s2v run` of ``flags`` in a new directory ``d`` (frames written with --frames-out):
    (the frames, the run directory). Fails the test when the run fails."""
    d.mkdir()
    r = run_cli(["run", *flags, *asset_flags(assets), "--output", str(d / "o.mp4"), "--frames-out",
                 str(d / "f.pt"), "--runs-root", str(d / "runs"), *extra], cwd=d)
    assert r.returncode == 0, r.output
    return torch.load(d / "f.pt"), next((d / "runs").glob("*"))


@pytest.fixture(scope="session")
def reference_frames(tiny_assets):
    """One process's frames for the shared tiny spec (TINY_FLAGS), computed in this process by the
    loop a ``--nproc 1`` run's worker runs: what every parallel layout must equal."""
    with cpu_engine(tiny_assets) as engine:
        return one_process_frames(engine)


@pytest.fixture(scope="session")
def pose_reference_frames(tiny_assets):
    """One process's frames for the shared tiny spec with the demo's pose video (``--pose-video``;
    15 of the 16 pose frames of 2 clips, the last padded): what the layouts run with it must equal."""
    with cpu_engine(tiny_assets) as engine:
        return one_process_frames(engine, pose_video=tiny_assets.pose_video)


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
    tests/test_supervision.py). A second 2-rank run (one clip, one step) starts at the same moment;
    neither names a --master-port, so each rendezvous binds a port the OS picks."""
    d, other = tmp_path_factory.mktemp("hybrid"), tmp_path_factory.mktemp("hybrid_other")
    common = [*TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "2", "--watchdog-load", "90"]
    env = cli_env()
    second = subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "run", *common, "--num-clips", "1",
                               "--steps", "1", "--output", str(other / "out" / "video.mp4"),
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
    """One ``wan-s2v serve`` (2 ranks, ulysses, a token, ``inputs`` allowed) for the session: the
    serve, page and client tests take it in turn, the way a server lives."""
    from serving import POISON, SERVER_FLAGS, TOKEN, ServerProcess

    d = tmp_path_factory.mktemp("serve") / "server dir"
    flags = [*SERVER_FLAGS, "--ckpt-dir", str(tiny_assets.ckpt_dir), "--token", TOKEN,
             "--allow-dir", str(inputs["root"]), "--max-queue", "6", "--max-upload-mb", "1"]
    s = ServerProcess(d, flags, env={"WAN_S2V_TEST_FAULT": POISON})
    yield s
    assert s.stop() == [] and "serve: stopping the rank group" in s.text()  # SIGTERM leaves nothing running
