"""Step caching (``--cache``) and the few-step recipe.

* The setting: its texts, its refusals (one line, with the fix), what the doctor says a clip costs.
* Threshold 0 computes every step and equals ``off`` bit for bit; a threshold reuses steps after
  the warm-up and never the last; the decisions and frames of one process are the reference.
* Every layout takes the same decisions and makes the same frames as one process (real ranks
  over gloo, fp32: exact): Ulysses x CFG-parallel at 4 ranks; fsdp-fixed, failed in clip 2 and
  resumed in hybrid mode (a resumed cached run equals the uninterrupted one); run.json, the
  events and the progress line say which steps were reused.
* The few-step recipe (the ComfyUI S2V template's: 4 steps, CFG 1, shift 8, a LightX2V-format
  T2V LoRA merged into the S2V DiT) in every mode equals one process.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CACHE, TINY_FLAGS, asset_flags, one_process_cached, run_cli
from fault_worker import fault_env

from wan_s2v_runner.shared import cache_policy, exit_codes, media
from wan_s2v_runner.shared.spec import JobSpec

CACHED = ["--steps", "8", "--cache", CACHE]  # after TINY_FLAGS: 8 steps (its 2 leave nothing to reuse)
#: the ComfyUI S2V template's few-step settings (with a 4-step LoRA merged)
RECIPE = ["--steps", "4", "--guide-scale", "1", "--shift", "8"]


# --------------------------------------------------------------------------- the setting
def test_the_setting_and_its_refusals(tmp_path):
    from wan_s2v_runner.shared.config import env_values, load_toml

    assert cache_policy.canonical("off") == "off"
    assert cache_policy.canonical("EasyCache") == cache_policy.canonical("easycache:0.05") == "easycache:0.05"
    assert cache_policy.canonical("easycache:0") == "easycache:0.0"
    spec = dict(image="/tmp/i.png", audio="/tmp/a.wav", prompt="p")
    assert JobSpec(**spec).cache == "off" and JobSpec(**spec, cache="easycache:.1").cache == "easycache:0.1"
    for bad, says in (("teacache", "is not one of off, easycache"), ("easycache:nan", "not a number from 0 to 10"),
                      ("easycache:-1", "not a number"), ("easycache:11", "not a number"),
                      ("off:0.1", "takes no threshold")):
        with pytest.raises(ValueError, match=says) as e:
            JobSpec(**spec, cache=bad)
        assert "Fix: " in str(e.value)
    # the environment and the run file set it as a flag does
    assert env_values({"WAN_S2V_CACHE": "easycache:0.1"}) == {"cache": "easycache:0.1"}
    toml = tmp_path / "run.toml"
    toml.write_text('[run]\ncache = "easycache"\n')
    assert load_toml(toml) == {"cache": "easycache"}
    assert [cache_policy.warmup_steps(n) for n in (4, 8, 20, 40)] == [2, 2, 4, 7]  # EasyCache: 7 of 40
    assert cache_policy.always_computed(40) == 8 and cache_policy.always_computed(2) == 2


def test_the_doctor_counts_the_passes_a_clip_costs():
    from wan_s2v_runner.preflight.checks_sampling import check_passes
    from wan_s2v_runner.shared.layout import Mode

    def said(**spec):
        return check_passes(SimpleNamespace(mode=Mode.ULYSSES, spec=SimpleNamespace(**{"cache": "off", **spec})))

    r = said(steps=40, guide_scale=4.5)
    assert r.data["most"] == r.data["fewest"] == 80 and "80 DiT passes a clip" in r.finding
    r = said(steps=4, guide_scale=1.0)  # the few-step recipe: CFG 1 skips the unconditional pass
    assert r.data["most"] == 4 and "the unconditional pass is skipped" in r.finding
    r = said(steps=40, guide_scale=4.5, cache="easycache:0.05")
    assert (r.data["most"], r.data["fewest"]) == (80, 16) and "computes at least 16" in r.finding
    assert said(steps=40, guide_scale=4.5, cache="easycache:0.0").data["fewest"] == 80
    # a live job: the recipe's 4 steps without CFG, whatever the flags say
    live = check_passes(SimpleNamespace(mode=Mode.LIVE, spec=SimpleNamespace(steps=40, guide_scale=4.5, cache="off")))
    assert live.data["most"] == 4 and "4 DiT passes a block" in live.finding


def test_the_cache_is_part_of_a_jobs_identity(tiny_assets):
    from wan_s2v_runner.serve.submissions import request_hash
    from wan_s2v_runner.shared import resume
    from wan_s2v_runner.shared.jobs import SUBMIT_FIELDS
    from wan_s2v_runner.shared.spec import RunSpec

    assert "cache" in SUBMIT_FIELDS  # a batch line and a server submission take it
    spec = RunSpec(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, audio=tiny_assets.audio, prompt="p")
    off = resume.spec_digest(spec)
    assert resume.spec_digest(spec.model_copy(update={"cache": "easycache:0.05"})) != off
    assert resume.spec_digest(spec.model_copy(update={"cache": "easycache:0.1"})) not in (
        off, resume.spec_digest(spec.model_copy(update={"cache": "easycache:0.05"})))
    # the default's spelling is the same job; off digests as a spec from before --cache did
    spelled = RunSpec(**{**spec.model_dump(include=set(RunSpec.model_fields)), "cache": "EasyCache"})
    assert resume.spec_digest(spelled) == resume.spec_digest(spec.model_copy(update={"cache": "easycache:0.05"}))
    assert "cache" not in json.loads(spec.model_dump_json(include=set(resume.FRAME_FIELDS) - {"cache"}))
    # an Idempotency-Key sent again with another cache setting is another request (409): the hash
    # covers the field (the same request with it left out or changed hashes otherwise)
    same = {"prompt": "p", "cache": "easycache:0.05"}
    assert request_hash(same) == request_hash(dict(same)) != request_hash({**same, "cache": "easycache:0.1"})


def test_a_bad_setting_is_refused_wherever_it_comes_from(tiny_assets, tmp_path, capsys):
    """The flag, a batch line, the environment and the doctor's draft all check it (one line, the
    fix); a bad environment value is ignored as every other one is, and the doctor does not crash."""
    from wan_s2v_runner.cli import main as cli
    from wan_s2v_runner.shared.config import draft, env_values

    assert env_values({"WAN_S2V_CACHE": "teacache"}) == {}
    assert env_values({"WAN_S2V_CACHE": "EasyCache"}) == {"cache": "easycache:0.05"}
    lenient = draft({"cache": "teacache", "steps": 40})
    assert lenient.error is not None and "cache policy 'teacache'" in str(lenient.error)
    code = cli.main(["doctor", "--ckpt-dir", str(tiny_assets.ckpt_dir), "--device", "cpu", "--cache", "teacache",
                     "--json"])
    out = capsys.readouterr()
    assert code != 0 and "Traceback" not in out.err
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"cache": "easycache:-1"}) + "\n")
    code = cli.main(["batch", str(jobs), *TINY_FLAGS, *asset_flags(tiny_assets), "--output-dir", str(tmp_path / "o"),
                     "--runs-root", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == exit_codes.PREFLIGHT and "not a number from 0 to 10" in err, err  # the line's own check
    assert not (tmp_path / "runs").exists()


def test_the_decision_rules():
    """Without a process group: warm-up and last step computed; a step is reused only with a rate
    measured on two computed steps; no reuse from a zero output, an unchanged input or a NaN."""
    from wan_s2v_runner.rank.step_cache import StepCache
    from wan_s2v_runner.shared.cache_policy import parse

    def run(outputs, threshold="easycache:5", steps=8):
        cache = StepCache.for_clip(parse(threshold), steps, measures=True)
        x, measure = torch.ones(4), -1.0
        for i in range(steps):
            if cache.reuse(i, x, measure) is None:
                cache.computed(i, x, outputs(i, x))
            x = x * 0.9
            measure = cache.measure(i + 1, x)  # at the step's end: the next step's, as the loop's message carries it
        return cache.record(1)

    assert run(lambda i, x: 2 * x) == {"clip": 1, "computed": [1, 2, 8], "reused": [3, 4, 5, 6, 7]}
    assert run(lambda i, x: 0 * x)["reused"] == []  # mean|v| 0: no relative change to predict
    assert run(lambda i, x: torch.full_like(x, float("nan")))["reused"] == []
    assert run(lambda i, x: 2 * x, threshold="easycache:0")["computed"] == list(range(1, 9))
    const = StepCache.for_clip(parse("easycache:5"), 8, measures=True)
    for i in range(8):  # the input never changes: no rate can be measured, every step is computed
        assert const.reuse(i, torch.ones(4), const.measure(i, torch.ones(4))) is None
        const.computed(i, torch.ones(4), torch.ones(4))
    assert const.record(1)["reused"] == []


# --------------------------------------------------------------------------- one process
def test_threshold_0_is_off_and_a_threshold_reuses_steps(engine_cpu, cached_reference):
    from conftest import one_process_frames

    off = one_process_frames(engine_cpu, steps=8)
    zero, zero_records = one_process_cached(engine_cpu, steps=8, cache="easycache:0")
    assert torch.equal(zero, off)  # computing every step with the cache's bookkeeping changes no bit
    assert [r["computed"] for r in zero_records] == [list(range(1, 9))] * 2
    frames, records = cached_reference
    assert len(records) == 2  # one record per clip
    for r in records:
        assert r["computed"][:2] == [1, 2] and r["computed"][-1] == 8  # warm-up and the last step
        assert r["reused"] and sorted(r["computed"] + r["reused"]) == list(range(1, 9))
    assert not torch.equal(frames, off) and (frames - off).abs().max() < 0.1  # near, not equal (random weights)
    # an fp8 DiT (--dit-quant fp8) under the cache: threshold 0 is its uncached run, a threshold reuses steps
    fp8 = one_process_frames(engine_cpu, steps=8, dit_quant="fp8")
    assert torch.equal(one_process_cached(engine_cpu, steps=8, dit_quant="fp8", cache="easycache:0")[0], fp8)
    assert all(r["reused"] for r in one_process_cached(engine_cpu, steps=8, dit_quant="fp8", cache=CACHE)[1])


# --------------------------------------------------------------------------- every layout
def _run(assets, d: Path, *extra, env=None):
    d.mkdir(exist_ok=True)
    return run_cli(["run", *TINY_FLAGS, *asset_flags(assets), *CACHED, "--output", str(d / "o.mp4"),
                    "--frames-out", str(d / "f.pt"), "--runs-root", str(d / "runs"), "--json", *extra],
                   cwd=d, env=env)


@pytest.mark.slow(seconds=45)
def test_every_layout_takes_the_same_decisions_as_one_process(tiny_assets, cached_reference, tmp_path):
    """Ulysses x CFG-parallel at 4 ranks == one process; fsdp-fixed at 2 ranks, failed in clip 2,
    resumed in hybrid mode == one process (decisions and frames, exact)."""
    frames, records = cached_reference
    with ThreadPoolExecutor(2) as pool:  # the two groups at once: one's start-up overlaps the other's compute
        sp_cfg = pool.submit(_run, tiny_assets, tmp_path / "sp_cfg", "--nproc", "4", "--cfg-parallel")
        fsdp = pool.submit(_run, tiny_assets, tmp_path / "fsdp", "--mode", "fsdp-fixed", "--nproc", "2",
                           env=fault_env("1:denoise@2:raise"))
        sp_cfg, fsdp = sp_cfg.result(), fsdp.result()

    assert sp_cfg.returncode == 0, sp_cfg.output
    manifest = json.loads(sp_cfg.stdout)
    assert (manifest["layout"]["cfg_degree"], manifest["layout"]["ulysses_degree"]) == (2, 2)
    assert torch.equal(torch.load(tmp_path / "sp_cfg" / "f.pt"), frames)
    assert manifest["step_cache"] == cache_policy.summary(CACHE, records)
    run_dir = Path(manifest["run_dir"])
    for rank in range(4):  # every rank took the same decisions, step by step
        events = [json.loads(line) for line in (run_dir / "events" / f"rank{rank}.jsonl").read_text().splitlines()]
        reused = [(e["clip"], e["step"]) for e in events if e["kind"] == "progress" and e["reused"]]
        assert reused == [(r["clip"], s) for r in records for s in r["reused"]], rank
        last = [e for e in events if e["kind"] == "progress"][-1]
        assert last["reused_steps"] == manifest["step_cache"]["steps_reused"]
    assert f"({manifest['step_cache']['steps_reused']} reused: --cache)" in sp_cfg.stderr  # the progress line

    assert fsdp.returncode == exit_codes.RANK_FAILED, fsdp.output
    failed = next((tmp_path / "fsdp" / "runs").iterdir())
    r = run_cli(["resume", str(failed), "--mode", "hybrid", "--nproc", "2", "--json"], cwd=tmp_path / "fsdp")
    assert r.returncode == 0, r.output
    resumed = json.loads(r.stdout)
    assert resumed["resume"]["at_clip"] == 2 and resumed["spec"]["cache"] == CACHE
    assert resumed["step_cache"] == cache_policy.summary(CACHE, records[1:])  # the clip it made
    # a resumed run's raw frames are the clips it made: clip 2 (clip 1: 8 - 3 frames)
    assert torch.equal(torch.load(tmp_path / "fsdp" / "f.pt"), frames[:, 5:])
    whole = tmp_path / "whole.mp4"  # and its video is one process's, byte for byte
    media.save_video_with_audio(frames, 16, tiny_assets.audio, whole, media.clip_lengths(frames.shape[1], 8))
    assert (tmp_path / "fsdp" / "o.mp4").read_bytes() == whole.read_bytes()


# --------------------------------------------------------------------------- the few-step recipe
def lightx2v_lora(ckpt: Path, out: Path) -> Path:
    """A LoRA in LightX2V's format for Wan T2V (its 4-step distillation LoRAs): ComfyUI keys,
    ``lora_down``/``lora_up``/``alpha`` on the blocks' attention and FFN, full ``diff`` deltas on
    norms and ``diff_b`` on biases; none for the S2V-only modules (a T2V LoRA has no audio parts)."""
    from safetensors.torch import save_file

    from wan_s2v_runner.loading.ckpt_tables import dit_shapes

    g, rank, sd = torch.Generator().manual_seed(5), 4, {}
    for name, shape in dit_shapes(ckpt).items():
        if not name.startswith("blocks."):
            continue
        module, kind = name.rsplit(".", 1)
        linear = module.rsplit(".", 1)[-1] in ("q", "k", "v", "o") or module.endswith((".ffn.0", ".ffn.2"))
        if kind == "weight" and linear:
            sd[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(rank, shape[1], generator=g) * 0.05
            sd[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(shape[0], rank, generator=g) * 0.05
            sd[f"diffusion_model.{module}.alpha"] = torch.tensor(float(rank))
        elif kind == "weight" and ".norm" in name:
            sd[f"diffusion_model.{module}.diff"] = torch.randn(*shape, generator=g) * 0.01
        elif kind == "bias":
            sd[f"diffusion_model.{module}.diff_b"] = torch.randn(*shape, generator=g) * 0.01
    save_file(sd, str(out))
    return out


@pytest.mark.slow(seconds=30)
def test_the_few_step_recipe_runs_in_every_mode(tiny_assets, engine_cpu, tmp_path):
    from patches import lora_merge
    from wan_s2v_runner.loading.lora import merger
    from wan_s2v_runner.shared.spec import LoraRef

    lora = lightx2v_lora(tiny_assets.ckpt_dir, tmp_path / "lightx2v_t2v_4step_lora.safetensors")
    lora_merge.apply(engine_cpu[0], merger([LoraRef(path=lora, strength=1.0)]))  # as a --nproc 1 run's worker does
    try:
        want, _ = one_process_cached(engine_cpu, steps=4, guide_scale=1.0, shift=8.0)
    finally:
        lora_merge.restore(engine_cpu[0])
    assert not torch.equal(want, one_process_cached(engine_cpu, steps=4, guide_scale=1.0, shift=8.0)[0])  # it merged
    modes = {"ulysses": ["--nproc", "2"], "fsdp-fixed": ["--mode", "fsdp-fixed", "--nproc", "2"],
             "hybrid": ["--mode", "hybrid", "--nproc", "2"]}

    def run(name, layout):
        d = tmp_path / name
        d.mkdir()
        return run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), *RECIPE, "--lora", f"{lora}:1.0", *layout,
                        "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                        "--runs-root", str(d / "runs"), "--json"], cwd=d)

    with ThreadPoolExecutor(len(modes)) as pool:
        runs = dict(zip(modes, pool.map(run, modes, modes.values())))
    for name, r in runs.items():
        assert r.returncode == 0, (name, r.output)
        manifest = json.loads(r.stdout)
        assert manifest["loras"][0]["unmatched_modules"] == 0 and manifest["spec"]["guide_scale"] == 1.0
        assert torch.equal(torch.load(tmp_path / name / "f.pt"), want), name


@pytest.mark.slow(seconds=60)
def test_a_compiled_dit_reuses_steps_as_the_eager_one(tiny_assets, engine_cpu, inductor_cache, tmp_path):
    """--compile with --cache: the compiled blocks run on the computed steps only, and the frames
    are the eager one process's within compile's frames bound (test_compile.FRAMES_BOUND). At
    threshold 10 every step between the warm-up and the last is reused, so compile's float
    rounding cannot move a decision."""
    from test_compile import FRAMES_BOUND

    want, records = one_process_cached(engine_cpu, steps=8, cache="easycache:10")
    assert [r["reused"] for r in records] == [[3, 4, 5, 6, 7]] * 2
    r = _run(tiny_assets, tmp_path / "compiled", "--nproc", "1", "--compile", "--cache", "easycache:10",
             env=inductor_cache)
    assert r.returncode == 0, r.output
    manifest = json.loads(r.stdout)
    assert manifest["stage_seconds"].get("compile", 0) > 0
    assert manifest["step_cache"] == cache_policy.summary("easycache:10.0", records)
    diff = (torch.load(tmp_path / "compiled" / "f.pt") - want).abs().max().item()
    assert diff <= FRAMES_BOUND, diff
