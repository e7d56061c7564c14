"""Several nodes, proven on one machine: two launcher invocations (the "nodes", one rank each)
rendezvous on loopback, configured only by the variables a cluster sets (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE`` = nodes, ``RANK`` = node index, as Vertex AI and PyTorchJob do;
the same by flags is test_serve's two-node server). Node 0 writes frames equal to one process's;
node 1 ends cleanly and says that node 0 writes the output. With ``--cfg-parallel`` at 2 nodes x
1 rank the two CFG branches run on different nodes. A node that never joins ends the other node's run
at the load watchdog's limit, with the missing node named; so does a node killed mid-run, at once
(its ranks the stub rank, tests/stub_rank.py: the supervisors are the subject)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import STUB_RANKS, TINY_FLAGS, asset_flags, cli_env, run_cli
from ports import named_port

from wan_s2v_runner.shared import exit_codes
from wan_s2v_runner.shared.node_agent import AGENT_MODULE


def _start_node(d, args: list[str], **env_vars: str) -> subprocess.Popen:
    """One "node": ``wan-s2v run ARGS`` in the new directory ``d``, with no cluster variables
    from this environment but ``env_vars``; stdout and stderr together."""
    d.mkdir()
    env = {k: v for k, v in cli_env(env_vars).items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") or k in env_vars}
    return subprocess.Popen([sys.executable, "-m", "wan_s2v_runner", "run", *args], cwd=d, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_two_nodes_on_loopback_equal_one_process(tiny_assets, reference_frames, tmp_path):
    """Configured only by the cluster's variables (the same layout by flags: test_serve's
    two-node server, --nnodes/--node-rank/--master-addr/--master-port)."""
    port = named_port()

    def start(node: int) -> subprocess.Popen:
        d = tmp_path / f"node{node}"
        args = [*TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1", "--output", str(d / "o.mp4"),
                "--frames-out", str(d / "f.pt"), "--runs-root", str(d / "runs"), "--cfg-parallel"]
        return _start_node(d, args, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(node))

    nodes = [start(0), start(1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "comm.master_addr" in outs[0] and "loopback" in outs[0]  # warned, not refused
    assert "node 1 done" in outs[1] and "node 0 writes" in outs[1], outs[1]
    assert torch.equal(torch.load(tmp_path / "node0" / "f.pt"), reference_frames)
    assert not (tmp_path / "node1" / "o.mp4").exists() and not (tmp_path / "node1" / "f.pt").exists()
    manifests = [json.loads(next((tmp_path / f"node{i}" / "runs").glob("*/run.json")).read_text()) for i in (0, 1)]
    for i, m in enumerate(manifests):
        lay = m["layout"]
        assert (lay["world_size"], lay["nnodes"], lay["node_rank"]) == (2, 2, i)
        assert lay["cfg_degree"] == 2  # the two CFG branches on different nodes
    assert manifests[0]["output"]["sha256"] and manifests[1]["output"] is None


@pytest.mark.slow
def test_a_node_that_never_joins_is_named(tiny_assets, tmp_path):
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1", "--nnodes", "2",
                 "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(named_port()),
                 "--watchdog-load", "8", "--output", str(tmp_path / "o.mp4"),
                 "--runs-root", str(tmp_path / "runs")], cwd=tmp_path, timeout=120)
    assert r.returncode == exit_codes.HUNG, r.output
    assert "waiting for node 1 of 2" in r.output, r.output
    assert not (tmp_path / "o.mp4").exists()


@pytest.mark.slow
def test_a_node_that_dies_mid_run_is_named(tiny_assets, tmp_path):
    """Node 1 vanishes while both nodes generate: its launcher, torchrun and worker SIGKILLed
    (sockets closed), and node 0's rank gets a connection error at once. Node 0 ends with exit 4
    and names node 1. (A node that freezes instead -- SIGSTOP, or a machine off the network --
    ends node 0's run at the step watchdog, the report pointing at node 1: measured by hand, 21 s
    with --watchdog-step 20; its stack analysis is unit-tested in tests/test_verdicts.py.)"""
    from wan_s2v_runner.launcher import proctree

    port = named_port()

    def start(node: int) -> subprocess.Popen:
        d = tmp_path / f"node{node}"
        return _start_node(d, [*TINY_FLAGS, *asset_flags(tiny_assets), "--nproc", "1", "--nnodes", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--steps", "8", "--output", str(d / "o.mp4"), "--runs-root", str(d / "runs")],
                           **STUB_RANKS)  # the supervisors' subject: ranks without the engine

    nodes = [start(0), start(1)]
    victims: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(
                '"denoise"' in p.read_text() for p in (tmp_path / "node1" / "runs").glob("*/events/*.jsonl")):
            assert nodes[1].poll() is None and nodes[0].poll() is None, "a node ended before denoising"
            time.sleep(0.3)
        # the node's launcher and everything of its run: its agent (forked by the warm agent, not
        # the launcher's child) and the agent's ranks
        victims = proctree.descendants([nodes[1].pid], proctree.ppid_map()) | {nodes[1].pid} | \
            proctree.pids_with_cmdline(AGENT_MODULE.encode(), str(tmp_path / "node1").encode())
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = nodes[0].communicate(timeout=120)[0]
        took = time.monotonic() - t0
    finally:
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in nodes:
            p.kill()
            p.communicate()
    assert nodes[0].returncode == exit_codes.RANK_FAILED, out
    assert "peer on another node: node 1 of 2 (global rank 1) went away first" in out, out
    assert took < 30
    assert not (tmp_path / "node0" / "o.mp4").exists()
