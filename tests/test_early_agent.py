"""Where the checks take seconds (:func:`wan_s2v_runner.preflight.probe.probes_quickly` is False:
GPUs to measure, or a CUDA build to import), ``wan-s2v run`` spawns its agent before them, so the
agent's imports overlap the probe's seconds (``launch.prepare``: an agent waiting for ``go``).
This CPU machine takes the other branch (the checks first: tests/test_imports.py), so this file
takes the GPU machine's with that one rule patched, the launcher in the test's process and the
agent and its rank real: a refusal ends the waiting agent before any rank and leaves nothing; an
accepted run's agent, told to go, makes one process's frames."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_FLAGS, asset_flags

from wan_s2v_runner.shared import exit_codes


def _agents(under: Path) -> list[int]:
    """Pids of the node agents whose command line names a run under ``under``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "wan_s2v_runner.rank.agent" in cmd and str(under) in cmd:
                out.append(int(d.name))
    return out


@pytest.mark.slow
def test_where_the_checks_measure_gpus_the_agent_imports_during_them(tiny_assets, reference_frames, tmp_path,
                                                                     monkeypatch, spawned_agent):
    from wan_s2v_runner import preflight
    from wan_s2v_runner.cli import main as cli
    from wan_s2v_runner.preflight import probe

    monkeypatch.setattr(probe, "probes_quickly", lambda: False)
    during = []
    checks = preflight.gate_report

    def gate_report(spec, **kw):
        during.append(_agents(tmp_path))
        return checks(spec, **kw)
    monkeypatch.setattr(preflight, "gate_report", gate_report)
    common = ["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1"]

    refused = tmp_path / "refused"
    code = cli.main([*common, "--image", str(tmp_path / "no-such.png"), "--output", str(refused / "o.mp4"),
                     "--runs-root", str(refused / "runs")])
    assert code == exit_codes.PREFLIGHT
    assert len(during) == 1 and len(during[0]) == 1, during  # the agent was importing while the checks ran
    assert _agents(tmp_path) == [] and not list(refused.rglob("*"))  # ended before any rank; nothing left

    ran = tmp_path / "ran"
    code = cli.main([*common, "--output", str(ran / "o.mp4"), "--frames-out", str(ran / "f.pt"),
                     "--runs-root", str(ran / "runs")])
    assert code == exit_codes.OK
    assert len(during) == 2 and len(during[1]) == 1, during
    assert torch.equal(torch.load(ran / "f.pt"), reference_frames)
    assert _agents(tmp_path) == []
