"""The layout knows its rules: one object per run answers every parallel-degree question, and the
doctor's checks, recommendation and memory plan ask it instead of re-deriving a rule."""
from __future__ import annotations

from pathlib import Path

import pytest

from wan_s2v_runner.preflight import CheckContext, MachineFacts, Status, recommend_mode, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.preflight.registry import groups_for
from wan_s2v_runner.shared import layout as layout_mod
from wan_s2v_runner.shared.layout import (
    MODES,
    Layout,
    MeshAxis,
    Mode,
    padded_length,
    sp_degree_fits,
    split_evenly,
    valid_sp_degrees,
)
from wan_s2v_runner.shared.spec import RunSpec

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
    """Any degree up to the head count and the shortest sequence: heads split as evenly as
    possible, tokens padded to a multiple of the degree."""
    assert sp_degree_fits(4, 40, [63360, 57152]) and sp_degree_fits(3, 40, [63360])
    assert sp_degree_fits(7, 40, [100]) and not sp_degree_fits(41, 40, [])
    assert not sp_degree_fits(8, 40, [5])  # a rank without a real token
    assert valid_sp_degrees(40, [32760], range(1, 17)) == list(range(1, 17))
    assert split_evenly(40, 3) == [14, 13, 13] and split_evenly(40, 8) == [5] * 8
    assert split_evenly(4, 3) == [2, 1, 1] and sum(split_evenly(40, 7)) == 40
    assert padded_length(63360, 7) == 63364 and padded_length(64, 4) == 64
    lay = Layout.for_mode(Mode.ULYSSES, 3)
    assert lay.problems(40, [99]) == [] and lay.head_split(40) == [14, 13, 13] and lay.heads_per_rank(40) == 14
    assert lay.padded_lengths([99, 100]) == [100] and lay.padding(100) == 2
    assert lay.padding_overhead([99, 100]) == 0.02
    assert "exceeds the 2 attention heads" in lay.problems(2, [99])[0]
    assert "exceeds the 2-token sequence" in Layout.for_mode(Mode.ULYSSES, 4).problems(40, [2, 100])[0]
    cfg = Layout.for_mode(Mode.ULYSSES, 6, cfg_parallel=True)  # CFG 2 x SP 3: the degree is 3
    assert cfg.sp_degree == 3 and cfg.padding(100) == 2 and cfg.head_split(4) == [2, 1, 1]
    assert Layout.for_mode(Mode.FSDP_FIXED, 3).problems(40, [7]) == []  # no SP: nothing to divide


def test_plans_per_gpu_count():
    """The doctor's table: the fastest valid split of each GPU count, explained."""
    from wan_s2v_runner.preflight.plans import best_plan, plan_table
    lengths = [59136, 63360]  # 1024x704, 80 frames: clip 1 and later clips
    table = plan_table(Mode.ULYSSES, 40, 5120, 13824, lengths)
    assert [p.layout.world_size for p in table] == list(range(1, 17)) and all(p.valid for p in table)
    # even counts split CFG (same compute, all-to-alls among half the ranks); odd counts cannot
    assert [p.layout.cfg_degree for p in table] == [1 if n % 2 else 2 for n in range(1, 17)]
    six = table[5]
    assert (six.layout.cfg_degree, six.layout.sp_degree, six.head_split) == (2, 3, [14, 13, 13])
    assert "CFG 2 x SP 3, heads 14/13/13 per rank, no padding, CFG split" in six.describe()
    seven = table[6]
    assert seven.padding_overhead > 0 and "padding 0/4 token(s)" in seven.describe()
    # uneven heads cost: 14 heads of 40 on the busiest rank of 3, not 13.33
    assert 2.8 < table[2].speedup < 3.0 and table[3].speedup == pytest.approx(4.0)
    assert table[15].speedup == pytest.approx(16.0)
    # no uncond pass (guide scale <= 1): no CFG split to offer
    assert best_plan(Mode.ULYSSES, 6, 40, 5120, 13824, lengths, cfg_possible=False).layout.sp_degree == 6
    # fsdp-fixed does not split the sequence: only the CFG split speeds it up
    assert [p.speedup for p in plan_table(Mode.FSDP_FIXED, 40, 5120, 13824, lengths, worlds=(3, 4))] == [1.0, 2.0]
    too_many = best_plan(Mode.ULYSSES, 3, 2, 64, 128, [100], cfg_possible=False)
    assert not too_many.valid and "exceeds the 2 attention heads" in too_many.describe()


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
    assert r.status is Status.FAIL and "every rank needs at least one" in r.finding
    rec = recommend_mode(CheckContext.for_values({"nproc": 2}, a100x8()))
    assert rec.mode is Mode.ULYSSES and rec.cfg_parallel  # CFG 2 x SP 1 needs no SP degree above 1
    rec = recommend_mode(CheckContext.for_values({"nproc": 4}, a100x8()))
    assert rec.mode is Mode.FSDP_FIXED and "exceeds the 40 attention heads" in rec.reason


@pytest.mark.parametrize("mode", list(Mode))
def test_memory_plan_follows_the_layout_not_the_mode_name(mode):
    from wan_s2v_runner.preflight.memory import plan_all, plan_mode
    ctx = CheckContext.for_values({"nproc": 4, "mode": mode.value}, a100x8())
    plans = plan_all(ctx)
    from wan_s2v_runner.preflight.memory import model_sizes, workload
    same = plan_mode(Layout.for_mode(mode, 4), model_sizes(ctx), workload(ctx), nproc=4, device="cuda",
                     offload=False)
    assert plans[mode.value] == same


def test_mesh_axes_are_named_by_the_enum_in_mesh_shape_order():
    assert [a.value for a in MeshAxis] == ["cfg", "sp"] and MeshAxis("sp") is MeshAxis.SP
    assert f"{MeshAxis.CFG}/{MeshAxis.SP}" == "cfg/sp" and MeshAxis.CFG == "cfg"  # plain names to torch
    lay = Layout.for_mode(Mode.HYBRID, 8, cfg_parallel=True)
    assert len(lay.mesh_shape) == len(MeshAxis) and lay.mesh_shape == (2, 4)


@pytest.mark.parametrize("mode, world, cfg_parallel, coords", [
    (Mode.ULYSSES, 1, False, [(0, 0)]),
    (Mode.ULYSSES, 4, False, [(0, 0), (0, 1), (0, 2), (0, 3)]),
    (Mode.ULYSSES, 2, True, [(0, 0), (1, 0)]),  # CFG 2 x SP 1
    (Mode.HYBRID, 6, True, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]),  # SP innermost
    (Mode.FSDP_FIXED, 4, True, [(0, 0), (0, 1), (1, 0), (1, 1)]),
])
def test_a_ranks_coordinates_come_from_the_layout(mode, world, cfg_parallel, coords):
    from wan_s2v_runner.rank.parallel import RankPlan

    lay = Layout.for_mode(mode, world, cfg_parallel=cfg_parallel)
    assert [lay.coords(r) for r in range(world)] == coords
    assert [(p.cfg_rank, p.sp_rank) for p in (RankPlan(lay, r) for r in range(world))] == coords
    assert RankPlan(lay, world - 1).describe()["cfg_rank"] == coords[-1][0]
    with pytest.raises(ValueError, match="outside a world"):
        lay.coords(world)


def test_the_layout_builds_its_device_mesh(tmp_path):
    """A real one-process gloo mesh: named by MeshAxis, its groups found by the enum."""
    import torch.distributed as dist

    from wan_s2v_runner.rank.parallel import RankPlan

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        lay = Layout.for_mode(Mode.ULYSSES, 1)
        mesh = lay.device_mesh("cpu")
        assert mesh.mesh_dim_names == tuple(MeshAxis) == ("cfg", "sp") and tuple(mesh.shape) == lay.mesh_shape
        plan = RankPlan(lay, 0, mesh)
        assert plan.sp_group is mesh.get_group("sp") and plan.cfg_group is mesh.get_group(MeshAxis.CFG)
        assert dist.get_world_size(plan.group(MeshAxis.SP)) == 1
    finally:
        dist.destroy_process_group()


def test_vae_split_is_on_with_several_ranks_unless_switched_off_or_too_few_rows():
    from wan_s2v_runner.rank.parallel import RankPlan

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


def test_the_plan_says_where_the_dit_loads_while_the_encoders_run():
    """A replicated DiT read leanly on CPU ranks loads while the encoders run; an FSDP-sharded one,
    one read with --load full, and one on a GPU (measured there: docs/gpu.md) load first. The doctor's
    memory plan line says which, from the same rule the ranks follow."""
    from wan_s2v_runner.shared.layout import LoadStrategy, dit_load_overlap

    for mode, device, load, overlap in ((Mode.ULYSSES, "cpu", "lean", True), (Mode.FSDP_FIXED, "cpu", "lean", False),
                                        (Mode.HYBRID, "cpu", "lean", False), (Mode.ULYSSES, "cpu", "full", False),
                                        (Mode.ULYSSES, "cuda", "lean", False)):
        got, why = dit_load_overlap(Layout.for_mode(mode, 2, cfg_parallel=mode is Mode.ULYSSES), device,
                                    LoadStrategy(load))
        assert got is overlap and why.startswith("while the encoders run" if overlap else "before the encoders"), why
        ctx = CheckContext.for_values({"nproc": 2, "mode": mode.value, "device": device, "load": load}, a100x8())
        r = find(run_checks(ctx, ["memory"]), "memory.plan")
        assert f"the DiT loads {why}" in r.finding and r.data["dit_load_overlap"] is overlap, r.finding
