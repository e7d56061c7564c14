"""The caches wan-s2v keeps, bounded, listed and cleared (issue #84): the DiT page-cache files'
budget and least-recently-used eviction (``shared.cache_budget``, ``loading.dit_cache.ensure``),
the marks of the files a process maps (a live one's survives eviction; a killed one's pins
nothing), the preflight's plan of the write (``output.dit_cache``: what goes, or the refusal
with its fix, and the budget the rank is given), ``wan-s2v cache list/clear`` through the command
line, one location rule (``shared.cache_dirs``), the doctor's sum, and a page-cache run after its
file was evicted: the file written again, the same frames.

The cache files here are small but real: written by ``dit_cache.ensure`` (their digests' names,
their trailers), for a two-Linear model or the tiny checkpoint's DiT.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, cli_env, cpu_engine, run_cli
from tests.test_block_stream import generate
from tests.test_page_cache_stream import FakeSource, five, paged  # noqa: F401 - five: the fixture
from wan_s2v_runner.loading import dit_cache, lean_load
from wan_s2v_runner.shared import cache_budget, cache_dirs, caches, dit_files
from wan_s2v_runner.shared.cache_budget import Budget, Held, Short, parse, plan_room
from wan_s2v_runner.shared.cache_dirs import CacheKind
from wan_s2v_runner.shared.layout import DitQuant, StreamSource

GiB, MiB = 2**30, 2**20
#: a model whose layout a child process builds alike (``_CHILD``)
SMALL = "torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))"


def small():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    return model, *lean_load._layout(model)


DEFAULT = Budget()


def write(directory: Path, key: str, about: dict | None = None, budget: Budget = DEFAULT, last_use=None):
    """A real cache file of ``small()`` under ``key`` (released: not marked); its last use set."""
    model, layout, total = small()
    got = dit_cache.ensure(dit_cache.DitCachePlace(directory, budget), dit_cache.CacheKey(key, about), layout, total,
                           FakeSource(model))
    got.release()
    if last_use is not None:
        os.utime(got.path, (last_use, got.path.stat().st_mtime))
    return got


def keys(directory: Path) -> set[str]:
    return {p.name[4:-4] for p in directory.glob("dit-*.bin")}


def test_the_budget_reads_sizes_and_shares_and_plans_least_recently_used_first():
    assert parse("200G") == Budget(size=200 * GiB) and parse("1.5TiB").size == int(1.5 * 2**40)
    assert parse("500mb").size == 500 * MiB and parse(123) == Budget(size=123) and parse(None) == Budget()
    assert parse("20%").cap(1000 * GiB) == 200 * GiB and Budget().cap(1000 * GiB) == 250 * GiB
    for bad in ("lots", "0%", "120%", "-5G"):
        with pytest.raises(cache_budget.BudgetError, match="not a size|share of the disk"):
            parse(bad)
    # the default never refuses the run's own file; a given budget does
    assert Budget().limit(40 * GiB, 28 * GiB) == 28 * GiB and parse("10G").limit(40 * GiB, 28 * GiB) == 10 * GiB
    files = [Held("new", 10, 300.0), Held("old", 10, 100.0), Held("mapped", 10, 50.0, in_use=True),
             Held("mid", 10, 200.0)]
    plan = plan_room(files, 10, budget=30, free=10**6, reserve=0)
    assert [h.name for h in plan.evict] == ["old", "mid"] and plan.fits and plan.kept_bytes == 20
    assert plan_room(files, 10, budget=50, free=10**6, reserve=0).evict == []
    # the disk: free + evicted - need must keep the reserve
    plan = plan_room(files, 10, budget=None, free=15, reserve=10)
    assert [h.name for h in plan.evict] == ["old"] and plan.free_after == 15
    # the file in use is never evicted: a budget it alone fills cannot be met
    plan = plan_room(files, 25, budget=30, free=10**6, reserve=0)
    assert plan.short is Short.BUDGET and [h.name for h in plan.evict] == ["old", "mid", "new"]
    assert cache_budget.room_budget(100, cache_bytes=50, free=60, video=20, floor=5) == 85
    assert cache_budget.room_budget(100, cache_bytes=50, free=500, video=20, floor=5) == 100


def test_lru_eviction_under_a_budget(tmp_path):
    """Writing a new file evicts the least recently used others until the files fit the budget
    (the file just found or written counts as used now); it says which went; a budget the new
    file alone exceeds is refused in one line before anything is removed or written."""
    d = tmp_path / "dit"
    first = write(d, "a" * 32, last_use=3000)
    size = first.path.stat().st_size
    write(d, "b" * 32, last_use=1000)
    write(d, "c" * 32, last_use=2000)
    need = dit_files.write_needs(first.nbytes)
    budget = Budget(size=need + 2 * size + size // 2)  # two files beside the new one
    got = write(d, "d" * 32, budget=budget)
    assert got.action == "written" and got.evicted == [f"dit-{'b' * 32}.bin"]
    assert keys(d) == {"a" * 32, "c" * 32, "d" * 32}
    assert not (d / f".dit-{'b' * 32}.lock").exists()  # its lock went with it
    got = write(d, "e" * 32, budget=budget)
    assert got.evicted == [f"dit-{'c' * 32}.bin"] and keys(d) == {"a" * 32, "d" * 32, "e" * 32}
    # a reuse is a use: "a" (found now) outlives "d", written before it
    assert write(d, "a" * 32, budget=budget).action == "reused"
    assert write(d, "f" * 32, budget=budget).evicted == [f"dit-{'d' * 32}.bin"]
    before = keys(d)
    with pytest.raises(dit_cache.DitCacheError) as e:
        write(d, "9" * 32, budget=Budget(size=need - 1))
    assert "\n" not in str(e.value) and "Fix: raise --dit-cache-max" in str(e.value)
    assert keys(d) == before


def test_a_mapped_file_survives_eviction_until_its_mapping_is_gone(tmp_path):
    """A file this process maps (``map_into``) is marked in use: a write that needs room evicts
    the next least recently used instead; once the mapping is let go, it is evictable."""
    d = tmp_path / "dit"
    model, layout, total = small()
    src = FakeSource(model)
    mapped = dit_cache.ensure(d, "a" * 32, layout, total, src)
    dit_cache.map_into(model, mapped, layout)  # model's parameters are views of the file's mapping
    assert mapped.mark is None  # ensure's mark handed over to the mapping's own
    os.utime(mapped.path, (1000, mapped.path.stat().st_mtime))  # the oldest
    write(d, "b" * 32, last_use=2000)
    assert dit_files.busy(mapped.path) and os.getpid() in dit_files.holders(mapped.path)
    size = mapped.path.stat().st_size
    need = dit_files.write_needs(total)
    budget = Budget(size=need + size + size // 2)
    assert write(d, "c" * 32, budget=budget).evicted == [f"dit-{'b' * 32}.bin"]
    assert torch.equal(model[0].weight, src.values["0.weight"])  # still mapped, still right
    del model
    gc.collect()
    assert not dit_files.busy(mapped.path)
    assert write(d, "e" * 32, budget=budget).evicted == [f"dit-{'a' * 32}.bin"]


_CHILD = f"""
import sys, torch
from wan_s2v_runner.loading import dit_cache, lean_load
with torch.device("meta"):
    model = {SMALL}
layout, total = lean_load._layout(model)
dit_cache.map_into(model, dit_cache.read(sys.argv[1], total, dit_cache.layout_digest(layout)), layout)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_killed_processs_mark_pins_nothing(tmp_path):
    """Another process maps a file: it is in use (its pid named), eviction and ``clear`` keep it;
    killed with SIGKILL (no clean-up of its own), its mark is gone with it and the file goes."""
    d = tmp_path / "dit"
    held = write(d, "a" * 32, last_use=1000)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(held.path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "mapped"
        assert dit_files.busy(held.path) and child.pid in dit_files.holders(held.path)
        entry = next(e for e in caches.list_caches(env={"WAN_S2V_DIT_CACHE_DIR": str(d), "HOME": str(tmp_path)})
                     if e.kind is CacheKind.DIT)
        assert entry.in_use and entry.file.pids == [child.pid]
        done = caches.clear([entry])
        assert done.removed == [] and "mapped by a running group (pid" in done.kept[0][1]
        need = dit_files.write_needs(held.nbytes)
        budget = Budget(size=need + held.path.stat().st_size // 2)  # room for the new file once the old one goes
        with pytest.raises(dit_cache.DitCacheError, match="in use by running groups"):
            write(d, "b" * 32, budget=budget)
        assert held.path.exists() and keys(d) == {"a" * 32}
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert not dit_files.busy(held.path) and dit_files.holders(held.path) == []
    assert write(d, "b" * 32, budget=budget).evicted == [held.path.name]
    assert keys(d) == {"b" * 32}


def test_one_location_rule(tmp_path, monkeypatch):
    """The root: the setting, else $WAN_S2V_CACHE_DIR, else $XDG_CACHE_HOME/wan-s2v, else
    ~/.cache/wan-s2v; the DiT's and inductor's own variables win for theirs; the plan's rule
    (stream_source), inductor's and the rank's place (``place_of`` a spec) are this one."""
    from wan_s2v_runner.shared import inductor, stream_source
    from wan_s2v_runner.shared.spec import GroupSpec
    env = {"HOME": "/h"}
    assert cache_dirs.root(env=env) == Path("/h/.cache/wan-s2v")
    assert cache_dirs.root(env={**env, "XDG_CACHE_HOME": "/x"}) == Path("/x/wan-s2v")
    assert cache_dirs.root(env={**env, "XDG_CACHE_HOME": "/x", "WAN_S2V_CACHE_DIR": "/w"}) == Path("/w")
    assert cache_dirs.root("/s", env={**env, "WAN_S2V_CACHE_DIR": "/w"}) == Path("/s")
    assert stream_source.cache_dir({**env, "WAN_S2V_CACHE_DIR": "/w"}) == Path("/w/dit")
    assert stream_source.cache_dir({**env, "WAN_S2V_DIT_CACHE_DIR": "/d"}, setting="/s") == Path("/d")
    assert stream_source.cache_dir({}) == Path("~/.cache/wan-s2v/dit")  # a recorded machine's unknown home
    assert inductor.cache_dir({**env, "WAN_S2V_CACHE_DIR": "/w"}) == Path("/w/inductor")
    assert inductor.cache_dir({**env, "TORCHINDUCTOR_CACHE_DIR": "/t"}, setting="/s") == Path("/t")
    assert not cache_dirs.owned(CacheKind.INDUCTOR, {"TORCHINDUCTOR_CACHE_DIR": "/t"})
    monkeypatch.delenv("WAN_S2V_DIT_CACHE_DIR", raising=False)
    group = GroupSpec(ckpt_dir=tmp_path, cache_dir=tmp_path / "c", dit_cache_max="20%")
    assert dit_cache.place_of(group) == dit_cache.DitCachePlace(tmp_path / "c" / "dit", Budget(share=0.2))
    from wan_s2v_runner.loading.components import LoadSettings
    assert LoadSettings.of(group).cache_dir == dit_cache.place_of(group)  # the rank reads the plan's place
    monkeypatch.setenv("WAN_S2V_DIT_CACHE_MAX", "5G")  # the environment's budget where the spec has none
    assert dit_cache.place_of(GroupSpec(ckpt_dir=tmp_path)).budget == Budget(size=5 * GiB)
    with pytest.raises(ValueError, match="'lots' is not a size"):
        GroupSpec(ckpt_dir=tmp_path, dit_cache_max="lots")


# --------------------------------------------------------------------------- the preflight
def _spec(five, tmp_path, **more):  # noqa: F811 - five: the fixture
    from wan_s2v_runner.shared.spec import RunSpec
    return RunSpec(ckpt_dir=five.ckpt_dir, image=five.image, audio=five.audio, prompt="p", device="cpu",
                   dit_offload="blocks", dit_stream_from="page-cache", cache_dir=tmp_path / "caches", **more)


def _check(spec, facts=None):
    from wan_s2v_runner.preflight import checks_cache
    from wan_s2v_runner.preflight.context import CheckContext
    return checks_cache.check_dit_cache(CheckContext.for_spec(spec, facts))


def test_the_preflight_lists_what_goes_and_settles_the_ranks_budget(five, tmp_path, monkeypatch):  # noqa: F811
    """A new file: the least recently used others named (warn), and the budget it settles for the
    rank makes the rank (a --nproc 1 load, in this process) evict just those; the run's own file
    there: reused, nothing written; the file alone over the budget: refused with the fix."""
    from wan_s2v_runner.preflight.core import CheckGroup, Status
    from wan_s2v_runner.preflight.doctor import GateReport
    d = tmp_path / "caches" / "dit"
    old = write(d, "a" * 32, {"checkpoint": "/elsewhere", "quant": "none", "dtype": "fp32"}, last_use=1000)
    write(d, "b" * 32, {"checkpoint": "/elsewhere", "quant": "fp8", "dtype": "fp32"}, last_use=2000)
    size = old.path.stat().st_size
    r = _check(_spec(five, tmp_path, dit_cache_max="1T"))
    assert r.status is Status.OK and "nothing evicted" in r.finding, r.finding
    need = r.data["file_bytes"]
    r = _check(_spec(five, tmp_path, dit_cache_max=str(need + size + size // 2)))
    assert r.status is Status.WARN and r.data["evicts"] == [str(old.path)], r.finding
    assert old.path.name in r.finding and "/elsewhere; fp32; no LoRA" in r.finding and "--dit-cache-max" in r.fix
    spec = _spec(five, tmp_path, dit_cache_max=str(need + size + size // 2))
    r.group = CheckGroup.OUTPUT
    settled = GateReport([r], (CheckGroup.OUTPUT,)).settled(spec)
    assert settled["dit_cache_max"] == str(r.data["budget_bytes"]) and int(settled["dit_cache_max"]) <= need + 2 * size
    # the rank, given that budget, evicts what the check listed
    monkeypatch.setenv("WAN_S2V_DIT_CACHE_DIR", str(d))
    monkeypatch.setenv("WAN_S2V_DIT_CACHE_MAX", settled["dit_cache_max"])
    with cpu_engine(five) as engine:
        _, parts = generate(engine, num_clips=1, **paged(0))
    entry = parts.load_report.strategy["dit_cache"]
    assert entry["action"] == "written" and entry["evicted"] == [old.path.name]
    del parts
    gc.collect()
    Path(entry["path"]).unlink()
    r = _check(_spec(five, tmp_path, dit_cache_max=str(need - 1)))
    assert r.status is Status.FAIL and "exceeds the budget" in r.finding and "\n" not in r.finding
    assert r.fix.startswith("raise --dit-cache-max ($WAN_S2V_DIT_CACHE_MAX) to at least")
    mine = {"checkpoint": str(five.ckpt_dir), "dit_file": None, "quant": "none", "dtype": "fp32", "loras": []}
    write(d, "c" * 32, mine)
    r = _check(_spec(five, tmp_path, dit_cache_max=str(need - 1)))
    assert r.status is Status.OK and r.finding.startswith(f"reuses {d / ('dit-' + 'c' * 32 + '.bin')}"), r.finding
    assert _check(_spec(five, tmp_path, dit_quant=DitQuant.FP8)).data.get("reuses") is None  # fp8: another file


def test_the_preflight_refuses_a_disk_without_room(five, tmp_path):  # noqa: F811
    """A recorded machine whose disk cannot hold the file beside the video: refused before anything
    spawns, with the fix; what it cannot know (the machine's cache files) is said."""
    from wan_s2v_runner.preflight.core import Status
    from wan_s2v_runner.preflight.facts import MachineFacts
    facts = json.loads((ROOT / "tests/data/machines/rtx3060_12gb_32gb.json").read_text())
    facts["disks"] = [{"path": "/", "free_mib": 0.5, "total_mib": 937000}]
    r = _check(_spec(five, tmp_path), MachineFacts(facts))
    assert r.status is Status.FAIL and "not enough disk" in r.finding and "planned as none" in r.finding
    assert "--cache-dir ($WAN_S2V_CACHE_DIR)" in r.fix and "--dit-stream-from memory" in r.fix
    facts["disks"] = [{"path": "/", "free_mib": 400000, "total_mib": 937000}]
    assert _check(_spec(five, tmp_path), MachineFacts(facts)).status is Status.OK
    r = _check(_spec(five, tmp_path).model_copy(update={"dit_stream_from": StreamSource.MEMORY}), MachineFacts(facts))
    assert r.status is Status.SKIP


def test_the_doctor_sums_the_caches_and_says_what_a_recorded_machine_cannot_know(tmp_path, monkeypatch):
    from wan_s2v_runner.preflight.doctor import doctor
    from wan_s2v_runner.preflight.facts import MachineFacts
    root = tmp_path / "root"
    write(root / "dit", "a" * 32)
    (root / "demo").mkdir()
    (root / "demo" / "x.bin").write_bytes(b"x" * 1000)
    monkeypatch.setenv("WAN_S2V_CACHE_DIR", str(root))
    monkeypatch.delenv("WAN_S2V_DIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    report = doctor({"device": "cpu"}).to_json()["caches"]
    want = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert report["known"] and report["total_bytes"] == want and report["by_kind"]["demo"] == 1000
    assert report["disk"]["free"] > 0 and "free of" in report["line"]
    recorded = MachineFacts.load(ROOT / "tests/data/machines/rtx3060_12gb_32gb.json")
    report = doctor({}, facts=recorded).to_json()["caches"]
    assert not report["known"] and report["total_bytes"] is None and "unknown for a recorded machine" in report["line"]
    assert report["disk"]["free"] == 402000 * MiB


# --------------------------------------------------------------------------- the command line
def test_cache_list_and_clear_through_the_command_line(tmp_path):
    """``wan-s2v cache`` lists every cache (plain lines off a terminal, JSON with --json: the DiT
    files' checkpoint, quantization, LoRAs, dtype), clears one by key, a kind, all; keeps a file
    in use and says so; an unknown target is one line with the fix, exit 2; a root of one's own not
    named wan-s2v (a shared ``~/.cache``, say) keeps its kind directories."""
    root = tmp_path / "wan-s2v"
    lora = {"path": "/loras/style.safetensors", "strength": 0.8, "sha256": "0" * 64, "bytes": 10}
    about = {"checkpoint": "/ckpt/Wan2.2-S2V-14B", "dit_file": None, "quant": "fp8", "dtype": "bf16", "loras": [lora]}
    one = write(root / "dit", "a1b2c3" + "0" * 26, about, last_use=1000)
    two = write(root / "dit", "f" * 32, {**about, "quant": "none", "loras": []}, last_use=2000)
    (root / "demo").mkdir()
    (root / "demo" / "tiny.bin").write_bytes(b"d" * 4096)
    (root / "inductor" / "k").mkdir(parents=True)
    (root / "inductor" / "k" / "kernel.so").write_bytes(b"k" * 2048)
    env = {"WAN_S2V_CACHE_DIR": str(root), "WAN_S2V_DIT_CACHE_DIR": "", "TORCHINDUCTOR_CACHE_DIR": ""}
    r = run_cli(["cache", "list"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.output
    lines = r.stdout.splitlines()
    assert any(line.startswith("dit") and str(one.path) in line and "/ckpt/Wan2.2-S2V-14B; bf16 + fp8; LoRA "
               "style.safetensors:0.8" in line for line in lines), r.stdout
    assert any(line.startswith("demo") and "4.0 KiB" in line for line in lines) and lines[-1].startswith("total: ")
    r = run_cli(["cache", "--json"], cwd=tmp_path, env=env)
    listed = json.loads(r.stdout)
    by_path = {c["path"]: c for c in listed["caches"]}
    assert by_path[str(one.path)]["about"]["loras"] == [lora] and by_path[str(one.path)]["kind"] == "dit"
    assert by_path[str(two.path)]["about"]["quant"] == "none" and not by_path[str(two.path)]["in_use"]
    assert listed["by_kind"]["inductor"] == 2048 and listed["total_bytes"] == sum(c["bytes"] for c in listed["caches"])
    r = run_cli(["cache", "clear", "nonsense"], cwd=tmp_path, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "Fix: name one that `wan-s2v cache list` shows" in r.stderr
    r = run_cli(["cache", "clear", "a1b2c3", "--json"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.output
    cleared = json.loads(r.stdout)["cleared"]
    assert [c["path"] for c in cleared["removed"]] == [str(one.path)] and not one.path.exists() and two.path.exists()
    fd = os.open(two.path, os.O_RDONLY)  # this process maps (marks) the other one
    try:
        dit_files.mark(fd)
        r = run_cli(["cache", "clear", "all"], cwd=tmp_path, env=env)
        assert r.returncode == 0, r.output
        assert f"kept {two.path}" in r.stdout and "mapped by a running group" in r.stdout
        assert two.path.exists() and not (root / "demo").exists() and not (root / "inductor").exists()
    finally:
        os.close(fd)
    r = run_cli(["cache", "clear", "dit"], cwd=tmp_path, env=env)
    assert r.returncode == 0 and not two.path.exists() and list((root / "dit").iterdir()) == [], r.output
    shared = tmp_path / "cache"  # e.g. --cache-dir ~/.cache: its demo/ may be another program's
    (shared / "demo").mkdir(parents=True)
    r = run_cli(["cache", "clear", "all"], cwd=tmp_path, env={**env, "WAN_S2V_CACHE_DIR": str(shared)})
    assert r.returncode == 0 and (shared / "demo").is_dir() and "not under a directory named wan-s2v" in r.stdout, \
        r.output


# --------------------------------------------------------------------------- a run after eviction
def test_a_page_cache_run_after_eviction_rebuilds_its_file_with_the_same_frames(five, tmp_path, monkeypatch):  # noqa: F811
    """In one process, as a --nproc 1 rank loads: a budget of one file; the full-precision run
    writes its file, an fp8 run evicts it (said in the load report), the full-precision run
    again evicts the fp8 one, writes its own again and makes the resident run's frames."""
    cache = tmp_path / "dit-cache"
    monkeypatch.setenv("WAN_S2V_DIT_CACHE_DIR", str(cache))
    with cpu_engine(five) as engine:
        want, _ = generate(engine, num_clips=1)
        got, parts = generate(engine, num_clips=1, **paged(0))
        first = parts.load_report.strategy["dit_cache"]
        assert first["action"] == "written" and torch.equal(got, want)
        del parts
        gc.collect()
        need = dit_files.write_needs(first["bytes"])
        monkeypatch.setenv("WAN_S2V_DIT_CACHE_MAX", str(need))  # the full-precision file alone
        _, parts = generate(engine, num_clips=1, **paged(0), dit_quant=DitQuant.FP8)
        fp8 = parts.load_report.strategy["dit_cache"]
        assert fp8["action"] == "written" and fp8["evicted"] == [Path(first["path"]).name]
        del parts
        gc.collect()
        assert not Path(first["path"]).exists()
        again, parts = generate(engine, num_clips=1, **paged(0))
        entry = parts.load_report.strategy["dit_cache"]
        assert (entry["action"], entry["path"], entry["evicted"]) == ("written", first["path"],
                                                                     [Path(fp8["path"]).name])
        assert torch.equal(again, want)
