"""The plan, the doctor and ``--mode auto`` with the streamed DiT (issue #57, part 5), on recorded
machines (tests/data/machines/): what a person with one RTX 4090 and 64 GB of RAM, a box of two,
a 16 GB card or a 5090 is told before they run (or buy).

Sizes are the 14B's (the reference table marked as read from a checkpoint, so that a plan that
does not fit refuses instead of warning).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import pytest
import torch

from tests.conftest import run_cli
from wan_s2v_runner.preflight.context import CheckContext
from wan_s2v_runner.preflight.core import Status
from wan_s2v_runner.preflight.facts import MachineFacts
from wan_s2v_runner.preflight.memory import REFERENCE, plan_all
from wan_s2v_runner.preflight.recommend import recommend_mode
from wan_s2v_runner.preflight.registry import run_checks
from wan_s2v_runner.shared.layout import DitOffload, Mode, StreamSource

MACHINES = os.path.join(os.path.dirname(__file__), "data", "machines")
SIZES = replace(REFERENCE, source="checkpoint (test: Wan2.2-S2V-14B sizes)")


def ctx_on(machine: str, **values) -> CheckContext:
    ctx = CheckContext.for_values({"mode": "ulysses", **values}, MachineFacts.load(f"{MACHINES}/{machine}.json"))
    ctx.cache["sizes"] = SIZES
    return ctx


def gpu_check(ctx):
    return next(r for r in run_checks(ctx, ["memory"]) if r.id == "memory.gpu")


@pytest.mark.parametrize("machine, size, quant", [
    ("rtx4090_1x", "1024*704", "fp8"), ("rtx4090_1x", "1024*704", "none"),
    ("rtx4090_2x", "1024*704", "fp8"), ("rtx4090_2x", "1024*704", "none"),
    ("rtx4060ti16_1x", "832*480", "fp8"), ("rtx4060ti16_1x", "832*480", "none"),
    ("rtx5090_1x", "1024*704", "none"), ("rtx3090_2x_nop2p", "1024*704", "fp8"),
])
def test_the_cards_people_own_fit_only_with_streaming(machine, size, quant):
    """Resident, no mode fits (each refuses, and names --dit-offload blocks first: the fix that keeps
    the frames); streamed, ulysses fits, and the check says by how much and what it streams."""
    values = {"max_area": size, "dit_quant": quant}
    resident = ctx_on(machine, **values)
    plans = plan_all(resident)
    assert set(plans) == {m.value for m in Mode} - {Mode.LIVE.value}  # the live mode: planned when asked for
    for mode, plan in plans.items():
        assert plan.gpu_peak > plan_free(resident), (mode, plan.gpu_peak)
    r = gpu_check(resident)
    assert r.status is Status.FAIL and "does not fit" in r.finding
    assert r.fix.startswith("add --dit-offload blocks (the DiT's blocks stream from host memory: est.")
    streamed = ctx_on(machine, dit_offload="blocks", **values)
    r = gpu_check(streamed)
    assert r.status in (Status.OK, Status.WARN) and "does not fit" not in r.finding, r.finding
    assert r.data["need"] <= r.data["free"]
    assert "the DiT streamed:" in r.finding and "pinned on the host" in r.finding
    assert r.data["copy_s"] < r.data["compute_s"]  # the copies hide behind the compute on every one of them
    host = next(x for x in run_checks(streamed, ["memory"]) if x.id == "memory.host")
    assert host.status is not Status.FAIL, host.finding  # 64 GB of RAM holds the pinned DiT and T5


def plan_free(ctx) -> int:
    from wan_s2v_runner.preflight.memory import free_gpu_bytes
    return free_gpu_bytes(ctx)


def test_the_streamed_plan_adds_two_slots_and_moves_the_dit_to_the_host():
    """The streamed plan's terms: the device holds the DiT less its streamed units plus two slots of
    the largest; the host holds the whole DiT (one rank: its own; several: the node's one copy);
    a 5090 keeps some blocks resident (the most that leave 10% of its memory free), a 4090 none."""
    one = ctx_on("rtx4090_1x", dit_offload="blocks")
    p = plan_all(one)["ulysses"]
    units = SIZES.unit_bytes(2, False)
    assert p.stream["resident_blocks"] == 0 and p.stream["slot_bytes"] == max(units)
    assert p.stream["bytes_per_pass"] == sum(units) and p.stream["pinned_bytes"] == p.parts["dit_weights"]
    resident = plan_all(ctx_on("rtx4090_1x"))["ulysses"]
    assert resident.gpu_phases["denoise"] - p.gpu_phases["denoise"] == sum(units) - 2 * max(units)
    # one rank: the streamed DiT's host copy is what offload's parked DiT costs a resident run
    assert p.host_rank0 == resident.host_rank0 and p.host_shared == 0
    assert p.host_rank0 > plan_all(ctx_on("rtx4090_1x", offload_model=False))["ulysses"].host_rank0
    two = plan_all(ctx_on("rtx4090_2x", dit_offload="blocks"))["ulysses"]
    assert two.host_shared >= two.parts["dit_weights"]  # one copy for the node's two ranks
    big = plan_all(ctx_on("rtx5090_1x", dit_offload="blocks"))["ulysses"]
    assert 0 < big.stream["resident_blocks"] < 40
    assert big.gpu_peak <= 0.9 * plan_free(ctx_on("rtx5090_1x"))
    given = plan_all(ctx_on("rtx5090_1x", dit_offload="blocks", resident_blocks=3))["ulysses"]
    assert given.stream["resident_blocks"] == 3
    # the most resident blocks that fit, though the peak is not monotonic in them (two streamed
    # units take two slots of the larger: more than keeping one of them)
    from wan_s2v_runner.preflight.memory import GPU_FILL, plan_mode, workload
    c = ctx_on("rtx5090_1x", dit_offload="blocks")
    fill = GPU_FILL * plan_free(c)

    def peak(r):
        return plan_mode(c.layout, SIZES, workload(c), nproc=1, device="cuda", offload=True, stream=r).gpu_peak
    chosen = big.stream["resident_blocks"]
    assert peak(chosen) <= fill and all(peak(r) > fill for r in range(chosen + 1, 41))
    assert peak(39) < peak(38)  # why the search scans from the top


def test_auto_streams_only_when_nothing_resident_fits():
    """--mode auto: an H100 holds the resident model (no streaming); one 4090 and two 3090s hold it
    only streamed (auto says so and turns it on); the 16 GB card at 832x480 too. What auto sets
    is what the launcher applies (``Recommendation.updates``), unless the user gave the flag."""
    def rec(machine, **values):
        ctx = CheckContext.for_values(values, MachineFacts.load(f"{MACHINES}/{machine}.json"))
        ctx.cache["sizes"] = SIZES
        return recommend_mode(ctx)
    assert rec("h100_1x").dit_offload is DitOffload.NONE
    r = rec("rtx4090_1x", dit_quant="fp8")
    assert (r.mode, r.dit_offload) == (Mode.ULYSSES, DitOffload.BLOCKS)
    assert "with the DiT's blocks streamed from host memory it fits" in r.reason and "the same frames" in r.reason
    assert r.updates({})["dit_offload"] is DitOffload.BLOCKS and "dit_offload" not in r.updates({"dit_offload": "none"})
    assert r.flags(False) == "ulysses --dit-offload blocks"
    r = rec("rtx3090_2x_nop2p")
    assert (r.mode, r.dit_offload) == (Mode.ULYSSES, DitOffload.BLOCKS) and "without P2P" in r.reason
    assert rec("rtx4060ti16_1x", max_area="832*480").dit_offload is DitOffload.BLOCKS
    # never when the user set --dit-offload (here: none), nor under --load full (it cannot stream):
    # the answer is what it was before streaming (nothing fits: hybrid, said so)
    for values in ({"dit_offload": "none"}, {"load": "full"}):
        r = rec("rtx4090_1x", dit_quant="fp8", **values)
        assert (r.mode, r.dit_offload) == (Mode.HYBRID, DitOffload.NONE), values


def test_the_gate_fills_in_the_resident_blocks():
    """The run's gate settles --resident-blocks from the plan when the user left it to the plan."""
    from wan_s2v_runner.preflight.doctor import GateReport
    from wan_s2v_runner.preflight.registry import groups_for
    ctx = ctx_on("rtx5090_1x", dit_offload="blocks")
    report = GateReport(run_checks(ctx, ["memory"]), tuple(groups_for(Mode.ULYSSES)))
    want = plan_all(ctx)["ulysses"].stream["resident_blocks"]
    # and where the streamed bytes live, as the plan counted them (auto resolved for the rank)
    assert report.settled(ctx.spec) == {"resident_blocks": want, "dit_stream_from": StreamSource.MEMORY}
    assert report.settled(ctx.spec.model_copy(update={"resident_blocks": 2, "dit_stream_from": "memory"})) == {}


def test_doctor_plans_for_a_recorded_machine(tmp_path):
    """``wan-s2v doctor --machine FACTS.json``: the plan for that machine (--json as today); a
    missing or foreign file: a usage error naming the cause and the fix."""
    r = run_cli(["doctor", "--machine", f"{MACHINES}/rtx4090_1x.json", "--dit-quant", "fp8", "--json"], cwd=tmp_path)
    report = json.loads(r.stdout)
    assert report["machine"]["gpus"] == ["NVIDIA GeForce RTX 4090"]
    assert report["recommendation"]["dit_offload"] == "blocks"
    plans = report["memory_plan"]["modes"]
    assert plans["ulysses"]["stream"]["resident_blocks"] == 0
    gpu = next(c for c in report["results"] if c["id"] == "memory.gpu")
    assert "the DiT streamed" in gpu["finding"] and "PCIe 4.0 x16" in gpu["finding"]
    (tmp_path / "x.json").write_text('{"schema": 99}')
    for bad, words in ((tmp_path / "none.json", "cannot read it"), (tmp_path / "x.json", "not a machine-facts")):
        r = run_cli(["doctor", "--machine", str(bad)], cwd=tmp_path)
        assert r.returncode == 2 and f"--machine {bad}: {words}" in r.stderr and "Fix:" in r.stderr


def test_pages_that_cannot_be_pinned_stream_pageable_with_a_warning(tiny_assets, caplog):
    """A pinner that refuses (the host short of memory, WSL2's half of the RAM): the streamer asks it
    once per host storage (read-only for the node's shared copy), says why with the fix, and marks
    its copies pageable."""
    from wan_s2v_runner.loading import block_stream
    from wan_s2v_runner.loading.engine import import_wan
    wan = import_wan()
    model = wan.modules.s2v.model_s2v.WanModel_S2V.from_pretrained(str(tiny_assets.ckpt_dir)).eval()
    calls = []

    def refusing(tensors, read_only):
        calls.append((len({t.untyped_storage().data_ptr() for t in tensors}), read_only))
        return 0, ["1.0 GiB: cudaError 2"], []
    with caplog.at_level(logging.WARNING, logger="wan_s2v.block_stream"):
        s = block_stream.attach(model, torch.device("cpu"), 0, pinner=refusing, read_only=True)
    assert calls == [(sum(len(u.params) for u in s.units), True)]  # a model from a file: one storage a tensor
    assert s.describe()["pageable"] and s.describe()["pinned_bytes"] == 0
    assert "could not all be pinned (1.0 GiB: cudaError 2): its copies are pageable" in caplog.text
    s.detach()


def test_the_pinned_copy_is_checked_against_the_ram():
    """memory.pinned: the streamed DiT's host copy against the RAM; on WSL2 (whose driver pins at
    most about half the RAM) a bf16 DiT on a 64 GB machine warns, fp8 does not."""
    import copy
    r = next(x for x in run_checks(ctx_on("rtx4090_1x", dit_offload="blocks"), ["memory"]) if x.id == "memory.pinned")
    assert r.status is Status.OK and "30.4 GiB of the DiT pinned by the rank" in r.finding
    raw = copy.deepcopy(MachineFacts.load(f"{MACHINES}/rtx4090_1x.json").raw)
    raw["os"] = "Linux 5.15.167.4-microsoft-standard-WSL2"
    for quant, status in (("none", Status.WARN), ("fp8", Status.OK)):
        values = {"mode": "ulysses", "dit_offload": "blocks", "dit_quant": quant}
        ctx = CheckContext.for_values(values, MachineFacts(raw))
        ctx.cache["sizes"] = SIZES
        r = next(x for x in run_checks(ctx, ["memory"]) if x.id == "memory.pinned")
        assert r.status is status, (quant, r.finding)
        if status is Status.WARN:
            assert "WSL2's driver pins at most about half the RAM" in r.finding and "--dit-quant fp8" in r.fix
    skipped = next(x for x in run_checks(ctx_on("rtx4090_1x"), ["memory"]) if x.id == "memory.pinned")
    assert skipped.status is Status.SKIP


def test_a_streamed_run_always_takes_t5_off_the_gpu():
    """With --dit-offload blocks T5 goes back to the CPU after encoding whatever the ranks (the plan
    counts it so: 2x 24 GB fit only that way), and the DiT is never moved whole."""
    from wan_s2v_runner.shared.spec import RunSpec
    base = dict(ckpt_dir="c", image="i", audio="a", prompt="p", device="cuda")
    assert not RunSpec(**base, nproc=2).offload
    assert RunSpec(**base, nproc=2, dit_offload="blocks").offload
    assert RunSpec(**base, nproc=1, offload_model=False, dit_offload="blocks").offload
