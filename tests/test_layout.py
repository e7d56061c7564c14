"""The layout knows its rules: one object per run answers every parallel-degree question, and the
doctor's checks, recommendation and memory plan ask it instead of re-deriving a rule."""
from __future__ import annotations

from pathlib import Path

import pytest

from wan_s2v_runner import layout as layout_mod
from wan_s2v_runner.layout import MODES, Layout, Mode, sp_degree_fits, valid_sp_degrees
from wan_s2v_runner.preflight import CheckContext, MachineFacts, Status, recommend_mode, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.preflight.registry import groups_for
from wan_s2v_runner.spec import RunSpec

MACHINES = Path(__file__).parent / "data" / "machines"


def a100x8() -> MachineFacts:
    return MachineFacts.load(MACHINES / "a100_8x_nvlink.json")


def test_modes_map_to_layouts():
    assert Layout.for_mode(Mode.HYBRID, 4).model_dump() == dict(
        world_size=4, use_sp=True, dit_fsdp=True, t5_fsdp=False, t5_cpu=True, mode=Mode.HYBRID, cfg_degree=1,
        vae_parallel=True)
    assert Layout.for_mode(Mode.ULYSSES, 1).use_sp is False  # one rank: the plain engine path
    assert Layout.for_mode(Mode.FSDP_FIXED, 8).sp_degree == 1
    assert set(MODES) == set(Mode)
    spec = RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", mode="hybrid", nproc=2, nnodes=2)
    assert spec.layout == Layout.for_mode(Mode.HYBRID, 4)


def test_degree_rule():
    assert sp_degree_fits(4, 40, [63360, 57152]) and not sp_degree_fits(3, 40, [])
    assert not sp_degree_fits(8, 40, [100])  # heads fit, tokens do not
    assert valid_sp_degrees(40, [32760]) == [1, 2, 4, 8]
    assert valid_sp_degrees(40, [63360], range(1, 11)) == [1, 2, 4, 5, 8, 10]
    lay = Layout.for_mode(Mode.ULYSSES, 3)
    assert lay.problems(40, [99]) == ["world size 3 does not divide the 40 heads"]
    lay = Layout.for_mode(Mode.ULYSSES, 4)
    assert lay.bad_lengths([100, 102]) == [102] and lay.heads_per_rank(40) == 10
    assert "does not divide the 100/102-token sequences" in lay.problems(40, [100, 102])[0]
    assert Layout.for_mode(Mode.FSDP_FIXED, 3).problems(40, [7]) == []  # no SP: nothing to divide


def test_check_groups_follow_the_modes_traits():
    names = {m: [g.value for g in groups_for(m)] for m in Mode}
    assert "ulysses_degree" in names[Mode.ULYSSES] and "fsdp" not in names[Mode.ULYSSES]
    assert "fsdp" in names[Mode.FSDP_FIXED] and "ulysses_degree" not in names[Mode.FSDP_FIXED]
    assert {"fsdp", "ulysses_degree"} <= set(names[Mode.HYBRID])


def test_checks_and_recommendation_ask_the_layout(monkeypatch):
    """Change the one rule (here: no Ulysses degree above 1 is valid) and every consumer follows."""
    ctx = CheckContext.for_values({"nproc": 2, "mode": "ulysses"}, a100x8())
    assert find(run_checks(ctx, ["ulysses_degree"]), "ulysses.heads").status is Status.OK
    assert recommend_mode(CheckContext.for_values({"nproc": 2}, a100x8())).mode is Mode.ULYSSES

    monkeypatch.setattr(layout_mod, "sp_degree_fits", lambda degree, heads, lengths: degree == 1)
    ctx = CheckContext.for_values({"nproc": 2, "mode": "ulysses"}, a100x8())
    r = find(run_checks(ctx, ["ulysses_degree"]), "ulysses.heads")
    assert r.status is Status.FAIL and "use 1 ranks" in r.fix
    rec = recommend_mode(CheckContext.for_values({"nproc": 2}, a100x8()))
    assert rec.mode is Mode.FSDP_FIXED and "does not divide" in rec.reason
    r = find(run_checks(CheckContext.for_values({"nproc": 16, "mode": "ulysses"}, a100x8()), ["gpus"]),
             "gpus.count")
    assert r.status is Status.FAIL and "(valid for ulysses with 40 heads: 1)" in r.fix


@pytest.mark.parametrize("mode", list(Mode))
def test_memory_plan_follows_the_layout_not_the_mode_name(mode):
    from wan_s2v_runner.preflight.memory import plan_all, plan_mode
    ctx = CheckContext.for_values({"nproc": 4, "mode": mode.value}, a100x8())
    plans = plan_all(ctx)
    from wan_s2v_runner.preflight.memory import model_sizes, workload
    same = plan_mode(Layout.for_mode(mode, 4), model_sizes(ctx), workload(ctx), nproc=4, device="cuda",
                     offload=False)
    assert plans[mode.value] == same


def test_vae_split_is_on_with_several_ranks_unless_switched_off_or_too_few_rows():
    from wan_s2v_runner.parallel import RankPlan

    assert not Layout.for_mode(Mode.ULYSSES, 1).splits_vae(704)  # one rank: the engine's own VAE calls
    two = Layout.for_mode(Mode.ULYSSES, 2)
    assert two.vae_parallel and two.splits_vae(64)
    assert not Layout.for_mode(Mode.ULYSSES, 2, vae_parallel=False).splits_vae(704)
    assert Layout.for_mode(Mode.ULYSSES, 1, vae_parallel=True).vae_parallel is False
    # one band of latent rows (8 pixel rows) per rank: 9 ranks need 72 pixel rows
    assert not Layout.for_mode(Mode.FSDP_FIXED, 9).splits_vae(64)
    assert Layout.for_mode(Mode.FSDP_FIXED, 9).splits_vae(72)
    spec = RunSpec(ckpt_dir="c", image="i", audio="a", prompt="p", nproc=2, vae_parallel=False)
    assert spec.layout.vae_parallel is False
    # every rank loads the VAE when it is split; otherwise only rank 0 does
    assert RankPlan(two, rank=1).needs_vae
    assert not RankPlan(Layout.for_mode(Mode.ULYSSES, 2, vae_parallel=False), rank=1).needs_vae
