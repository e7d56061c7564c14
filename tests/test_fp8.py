"""``--dit-quant fp8`` (issue #47, part 2): the DiT's big Linears in float8_e4m3fn, one scale
per output row, quantized as they are read (``wan_s2v_runner.loading.quantize``,
``patches.fp8_linear``).

What is proven here: the quantization itself (row scales, the largest magnitude of a row maps to
448, slices quantized after an agreed scale equal the whole tensor quantized); an fp8
``--dit-file`` is used as it is (its bytes and its scales, never requantized); every layout with
fp8 equals one rank with fp8 exactly (fp32 compute on the CPU; real ranks); and the distance of
fp8 frames from full precision on the tiny checkpoint (stated as a bound).
"""
from __future__ import annotations

import json

import pytest
import torch

from patches.fp8_linear import E4M3_MAX, Fp8Weight, quantized_name
from tests.conftest import TINY_FLAGS, asset_flags, cpu_engine, once_per_run, one_process_frames, run_cli
from tests.test_dit_file import COMFY, dir_tensors, fp8_file
from wan_s2v_runner.loading import ckpt_read
from wan_s2v_runner.loading.quantize import Fp8Source
from wan_s2v_runner.shared.layout import DitQuant
from wan_s2v_runner.shared.quant import is_fp8_weight

#: the tiny checkpoint's frames with an fp8 DiT against full precision (fp32 on the CPU), measured
#: 5.6e-4 max and 5.6e-5 mean absolute (frames in [-1, 1]): the bound asserted
FP8_FRAMES_BOUND = (2e-3, 2e-4)


def targets(table) -> list[str]:
    return [n for n in table if is_fp8_weight(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from wan_s2v_runner.demo.tiny_checkpoint import build_tiny_checkpoint
    return build_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt")


def test_quantization_by_rows_and_by_slices(ckpt):
    """Whole tensors: each row's largest magnitude maps to +-448 and every value is within
    e4m3's rounding (2^-4 relative, or its smallest step) of the original. Slices: partial row
    maxima agreed (here one process: no all-reduce needed), then any slice quantizes to the
    same bytes as the whole tensor."""
    with ckpt_read.SafetensorsFiles.in_dir(ckpt) as inner:
        names = targets(inner.table())
        assert len(names) == 2 * 10 + 2 * 4  # 2 blocks x (q,k,v,o x 2 attentions + 2 FFN) + 2 injectors x 4
        whole = Fp8Source(inner, names)
        q = {}
        for n in names:
            shape = whole.shapes[n]
            t = torch.empty(shape, dtype=torch.float8_e4m3fn)
            whole.read_flat(quantized_name(n), 0, t.view(-1))
            q[n] = t
            w = torch.empty(shape)
            inner.read_flat(n, 0, w.view(-1))
            s = whole.scales[n]
            assert torch.equal(q[n].float().abs().amax(dim=1), torch.full((shape[0],), E4M3_MAX))
            back = q[n].float() * s[:, None]
            assert ((back - w).abs() <= w.abs() * 2**-4 + s[:, None] * 2**-9).all(), n
        sliced = Fp8Source(inner, names)
        cuts = {n: [(0, 7), (7, 40), (47, whole.shapes[n][0] * whole.shapes[n][1] - 47)] for n in names}
        slices = [(quantized_name(n), a, torch.empty(b, dtype=torch.float8_e4m3fn)) for n in names for a, b in cuts[n]]
        sliced.measure(slices)
        sliced.agree_scales(torch.device("cpu"))
        for key, start, dest in slices:
            sliced.read_flat(key, start, dest)
        for n in names:
            got = torch.cat([d.view(torch.uint8) for k, _, d in slices if k == quantized_name(n)])
            assert torch.equal(got, q[n].view(torch.uint8).reshape(-1)), n
            assert torch.equal(sliced.scales[n], whole.scales[n])


def comfy_lora(ckpt, path, seed=3):
    """A random ComfyUI-format LoRA (rank 4, alpha 4) on a few fp8 Linears of both blocks and the
    audio injection, plus a bias delta (``diff_b``) on a kept parameter."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    shapes = {k: tuple(v.shape) for k, v in dir_tensors(ckpt).items()}
    out = {}
    for module in ("blocks.0.self_attn.q", "blocks.1.ffn.0", "blocks.1.cross_attn.o", "audio_injector.injector.1.v"):
        o, i = shapes[f"{module}.weight"]
        out[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(4, i, generator=g) * 0.3
        out[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(o, 4, generator=g) * 0.3
        out[f"diffusion_model.{module}.alpha"] = torch.tensor(4.0)
    out["diffusion_model.blocks.0.self_attn.q.diff_b"] = torch.randn(shapes["blocks.0.self_attn.q.bias"], generator=g)
    save_file(out, str(path))
    return path


def merged_file(ckpt, lora, path, base=None):
    """A full-precision (fp32) DiT file of ``base`` (default: the directory's weights) with the
    LoRA added in fp32: what --dit-quant fp8 must quantize when given the LoRA."""
    from safetensors.torch import save_file

    from wan_s2v_runner.loading.lora import LoraDeltas, LoraSource
    t = {k: v.float() for k, v in (base or dir_tensors(ckpt)).items()}
    deltas = LoraDeltas([LoraSource(lora, 1.0)], {k: tuple(v.shape) for k, v in t.items()})
    for n in deltas.names:
        t[n] = t[n] + deltas.delta(n)
    save_file(t, str(path))
    return path, deltas


def test_a_lora_is_merged_before_quantizing(ckpt, tmp_path):
    """With a LoRA, the fp8 weights are those of the merged full-precision weights, quantized; a
    kept parameter (a bias) gets the merge; on an fp8 file, the weights the LoRA changes are
    dequantized, merged and requantized (and said so), the others used as they are."""
    from safetensors.torch import load_file

    from wan_s2v_runner.loading.lora import LoraDeltas, LoraSource
    lora = comfy_lora(ckpt, tmp_path / "lora.safetensors")
    names = targets(dir_tensors(ckpt))

    def read(src) -> dict[str, torch.Tensor]:
        out = {}
        for n, (dtype, shape) in src.table().items():
            t = torch.empty(shape, dtype=dtype if dtype == torch.float8_e4m3fn else torch.float32)
            src.read_flat(n, 0, t.view(-1))
            out[n] = t.view(torch.uint8) if dtype == torch.float8_e4m3fn else t
        return out

    def deltas_for(inner):
        return LoraDeltas([LoraSource(lora, 1.0)], {n: s for n, (_, s) in inner.table().items()})

    merged, _ = merged_file(ckpt, lora, tmp_path / "merged.safetensors")
    inner = ckpt_read.SafetensorsFiles.in_dir(ckpt)
    with Fp8Source(inner, names, deltas_for(inner)) as a, \
            Fp8Source(ckpt_read.DitFileSource(merged), names) as b:
        got, want = read(a), read(b)
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), n
        assert torch.equal(a.scales["blocks.1.ffn.0.weight"], b.scales["blocks.1.ffn.0.weight"])
    plain = read(Fp8Source(ckpt_read.SafetensorsFiles.in_dir(ckpt), names))
    assert not torch.equal(plain[quantized_name("blocks.1.ffn.0.weight")], got[quantized_name("blocks.1.ffn.0.weight")])
    assert not torch.equal(plain["blocks.0.self_attn.q.bias"], got["blocks.0.self_attn.q.bias"])

    fp8 = tmp_path / "fp8.safetensors"
    dequantized = fp8_file(dir_tensors(ckpt), fp8, "comfy_quant", prefix=COMFY)
    remerged, _ = merged_file(ckpt, lora, tmp_path / "remerged.safetensors", base=dequantized)
    file_src = ckpt_read.DitFileSource(fp8)
    with Fp8Source(file_src, names, deltas_for(file_src)) as a, \
            Fp8Source(ckpt_read.DitFileSource(remerged), names) as b:
        assert a.requantized == {"blocks.0.self_attn.q.weight", "blocks.1.ffn.0.weight", "blocks.1.cross_attn.o.weight",
                                 "audio_injector.injector.1.v.weight"}
        assert len(a.as_is) == len(names) - 4
        got, want = read(a), read(b)
        raw = load_file(str(fp8))
        for n in names:
            q = quantized_name(n)
            if n in a.requantized:
                assert torch.equal(got[q], want[q]), n
            else:
                assert torch.equal(got[q], raw[COMFY + n].view(torch.uint8)), n


def test_an_fp8_file_is_used_as_it_is(ckpt, tmp_path):
    """A ComfyUI fp8 file under --dit-quant fp8: its float8_e4m3fn bytes are the weights and its
    per-tensor scale is every row's scale; nothing is requantized."""
    from safetensors.torch import load_file
    path = tmp_path / "fp8.safetensors"
    fp8_file(dir_tensors(ckpt), path, "comfy_quant", prefix=COMFY)
    raw = load_file(str(path))
    with Fp8Source(ckpt_read.DitFileSource(path), targets(dir_tensors(ckpt))) as src:
        assert src.as_is == set(src.shapes)
        for n, shape in src.shapes.items():
            t = torch.empty(shape, dtype=torch.float8_e4m3fn)
            src.read_flat(quantized_name(n), 0, t.view(-1))
            assert torch.equal(t.view(torch.uint8), raw[COMFY + n].view(torch.uint8)), n
        src.share_scales()
        scales = src.row_scales()
        for n, shape in src.shapes.items():
            file_scale = raw[COMFY + n.removesuffix(".weight") + ".weight_scale"]
            assert torch.equal(scales[n], file_scale.reshape(1, 1).expand(shape[0], 1)), n


@pytest.fixture(scope="session")
def fp8_one_clip(tiny_assets, tmp_path_factory):
    """One process's frames for the tiny spec's first clip with the fp8 DiT, once per test run
    (conftest.once_per_run): what the fp8 layouts, compiled or not, are held to."""
    def make():
        with cpu_engine(tiny_assets) as engine:
            return one_process_frames(engine, dit_quant=DitQuant.FP8, num_clips=1)
    return once_per_run(tmp_path_factory, "fp8_one_clip", make)


@pytest.mark.slow(seconds=40)
def test_fp8_frames_are_near_full_precision(tiny_assets, fp8_one_clip):
    """In this process: the fp8 DiT's frames are within the stated bound of full precision, and
    not equal to them (the fp8 weights are used); the model holds its Linears in fp8."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.shared.layout import Layout, Mode
    with cpu_engine(tiny_assets) as engine:
        fp8 = fp8_one_clip
        full = one_process_frames(engine, num_clips=1)
        wan, cfg, spec = engine
        parts = components.load(wan, cfg, str(spec.ckpt_dir), RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0),
                                torch.device("cpu"), 0, components.LoadSettings(dit_quant=DitQuant.FP8))
    d = (fp8 - full).abs()
    assert 0 < d.max() <= FP8_FRAMES_BOUND[0] and d.mean() <= FP8_FRAMES_BOUND[1], (d.max(), d.mean())
    held = [m for m in parts.noise_model.modules() if isinstance(m, Fp8Weight)]
    assert len(held) == 28 and all(m.weight.dtype == torch.float8_e4m3fn for m in held)
    assert parts.noise_model.blocks[0].self_attn.norm_q.weight.dtype == torch.float32
    assert "fp8: 28 Linears" in parts.load_report.strategy["dit_quant"]


@pytest.mark.slow(seconds=200)
def test_every_layout_with_fp8_equals_one_rank(tiny_assets, fp8_one_clip, tmp_path):
    """Real ranks, fp8 DiT: fsdp-fixed (the fp8 weights are FSDP units of their own, scales
    agreed by all-reduce), ulysses with CFG-parallel (the node's shared copy; rank 0's scales)
    and hybrid (reading in two waves; ``--fp8-matmul scaled-mm``: FSDP gathers the fp8 weights and
    each rank quantizes its own tokens), each at 2 ranks, equal one process with fp8 exactly."""
    with cpu_engine(tiny_assets) as engine:
        want = fp8_one_clip
        want_mm = one_process_frames(engine, dit_quant=DitQuant.FP8, num_clips=1, fp8_matmul="scaled-mm")
    for name, flags in (("fsdp", ["--mode", "fsdp-fixed"]), ("ulysses_cfg", ["--mode", "ulysses", "--cfg-parallel"]),
                        ("hybrid", ["--mode", "hybrid", "--load-waves", "2", "--fp8-matmul", "scaled-mm"])):
        d = tmp_path / name
        d.mkdir()
        r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--num-clips", "1", "--nproc", "2", *flags,
                     "--dit-quant", "fp8", "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                     "--runs-root", str(d / "runs")], cwd=d)
        assert r.returncode == 0, r.output
        mm = "scaled-mm" in flags
        assert torch.equal(torch.load(d / "f.pt"), want_mm if mm else want), name
        for rank in (0, 1):  # each rank's load report says what it holds and how it multiplies
            events = (next((d / "runs").glob("*")) / "events" / f"rank{rank}.jsonl").read_text()
            assert "fp8: 28 Linears" in events
            assert ("scaled-mm (torch's CPU kernel" if mm else "dequant (the weights dequantized") in events, name


@pytest.mark.slow(seconds=60)
def test_a_lora_with_fp8_over_fsdp_ranks_equals_one_process(tiny_assets, tmp_path):
    """Real ranks: fsdp-fixed at 2 ranks with a LoRA and fp8 equals one process with them, and
    one process equals the fp8 run of the merged full-precision weights (the LoRA is merged
    before quantizing, in every layout)."""
    lora = comfy_lora(tiny_assets.ckpt_dir, tmp_path / "style lora.safetensors")
    merged, _ = merged_file(tiny_assets.ckpt_dir, lora, tmp_path / "merged.safetensors")
    from wan_s2v_runner.shared.spec import LoraRef
    with cpu_engine(tiny_assets) as engine:
        want = one_process_frames(engine, dit_quant=DitQuant.FP8, num_clips=1,
                                  lora=[LoraRef.model_validate(str(lora))])
        assert torch.equal(want, one_process_frames(engine, dit_quant=DitQuant.FP8, num_clips=1, dit_file=merged))
    d = tmp_path / "run"
    d.mkdir()
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--num-clips", "1", "--nproc", "2", "--mode",
                 "fsdp-fixed", "--dit-quant", "fp8", "--lora", str(lora), "--output", str(d / "o.mp4"),
                 "--frames-out", str(d / "f.pt"), "--runs-root", str(d / "runs")], cwd=d)
    assert r.returncode == 0, r.output
    assert torch.equal(torch.load(d / "f.pt"), want)
    events = (next((d / "runs").glob("*")) / "events" / "rank1.jsonl").read_text()
    assert "LoRAs merged before quantizing (5 parameters)" in events


def test_fp8_refuses_what_it_is_not_built_for():
    from pydantic import ValidationError

    from wan_s2v_runner.shared.spec import GroupSpec
    for extra, needle in (({"load": "full"}, "--load full"),
                          ({"compile": True, "mode": "fsdp-fixed", "nproc": 2}, "--compile in fsdp-fixed mode"),
                          ({"compile": True, "mode": "hybrid", "nproc": 2}, "--compile in hybrid mode")):
        with pytest.raises(ValidationError, match=needle):
            GroupSpec(ckpt_dir="/x", dit_quant="fp8", **extra)
    assert GroupSpec(ckpt_dir="/x", dit_quant="fp8", compile=True, nproc=2).compile  # ulysses: compiled
    assert GroupSpec(ckpt_dir="/x", dit_quant="fp8").dit_quant is DitQuant.FP8


def test_the_settings_travel_in_the_groups_json(tmp_path):
    """The setting travels in the group's JSON (ranks, batch and serve read it back)."""
    from wan_s2v_runner.shared.spec import GroupSpec, read_spec
    p = tmp_path / "g.json"
    p.write_text(GroupSpec(ckpt_dir="/x", dit_quant="fp8", dit_file="/y/d.safetensors").to_json())
    g = read_spec(p)
    assert g.dit_quant is DitQuant.FP8 and str(g.dit_file) == "/y/d.safetensors"
    assert json.loads(p.read_text())["dit_quant"] == "fp8"


def test_the_memory_plan_and_doctor_know_fp8():
    """Recorded machines, reference sizes, 1024x704: fp8 holds the DiT in 53% of bf16's bytes; one
    48 GB card (L40S) does not fit the full-precision DiT and its fix names --dit-quant fp8, which
    fits; the plan never turns fp8 on by itself."""
    from pathlib import Path

    from wan_s2v_runner.preflight import CheckContext, MachineFacts, Status, run_checks
    from wan_s2v_runner.preflight.core import find
    from wan_s2v_runner.preflight.memory import plan_all
    machines = Path(__file__).parent / "data" / "machines"
    l40s = MachineFacts.load(machines / "l40s_1x.json")

    def ctx(**kw):
        return CheckContext.for_values(dict(device="cuda", nproc=1, max_area=1024 * 704, **kw), l40s)

    full, fp8 = plan_all(ctx())["ulysses"], plan_all(ctx(dit_quant="fp8"))["ulysses"]
    ratio = fp8.parts["dit_weights"] / full.parts["dit_weights"]
    assert 0.5 < ratio < 0.56, ratio
    assert fp8.gpu_peak < full.gpu_peak - 13 * 2**30
    r = find(run_checks(ctx(), ["memory"]), "memory.gpu")
    # (a warning, not a refusal, while the sizes are the reference's: no checkpoint given)
    assert r.status is Status.WARN and "does not fit" in r.finding and "--dit-quant fp8" in r.fix, (r.finding, r.fix)
    r = find(run_checks(ctx(dit_quant="fp8"), ["memory"]), "memory.gpu")
    assert r.status is Status.OK, r.finding
    assert "fp8 Linears" in find(run_checks(ctx(dit_quant="fp8"), ["memory"]), "memory.plan").finding
    # two 24 GB cards: hybrid with fp8 needs 10 GiB less than without (at 1024x704 still over 23.5 GiB)
    two = MachineFacts.load(machines / "rtx4090_2x.json")
    plans = [plan_all(CheckContext.for_values(dict(device="cuda", nproc=2, max_area=1024 * 704, dit_quant=q),
                                              two))["hybrid"].gpu_peak for q in ("none", "fp8")]
    assert plans[0] - plans[1] > 9 * 2**30


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("matmul", ["dequant", "scaled-mm"])
def test_a_compiled_fp8_block_is_one_graph_within_the_bound_of_eager(matmul):
    """--compile with fp8 (ulysses: the fp8 weights are the block's own tensors), either way an fp8
    Linear multiplies (scaled-mm measured faster than dequant only compiled): each block is still
    one graph with no break; dequant within test_compile's forward bound of the eager fp8 DiT,
    scaled-mm within half of what the activations' own rounding moves it."""
    from torch._dynamo.utils import counters

    from patches import attention, compile_blocks, context_cache, fp8_linear
    from tests.test_compile import FORWARD_BOUND, SMALL
    from wan_s2v_runner.demo.random_weights import dit_kwargs, random_dit, random_dit_inputs
    from wan_s2v_runner.loading.engine import import_wan
    from wan_s2v_runner.loading.quantize import quantize_loaded
    from wan_s2v_runner.preflight.geometry import token_counts

    wan = import_wan()
    attention.apply(wan, "sdpa")
    torch.manual_seed(0)
    model, _ = random_dit(wan, torch.device("cpu"), torch.float32, **SMALL)
    assert len(quantize_loaded(model)) == 4 * 10 + 3 * 4
    assert fp8_linear.set_matmul(model, matmul) == 4 * 10 + 3 * 4
    context_cache.apply(model)
    cfg = dit_kwargs(wan, **SMALL)
    x, t, cond, _ = random_dit_inputs(int(cfg["audio_dim"]), int(cfg["motion_frames"]), token_counts(128, 128, 8), 8,
                                      torch.device("cpu"), torch.float32, False)
    with torch.no_grad():
        eager = model(x, t=t, **cond)
        if matmul == "scaled-mm":  # the activations' own rounding to e4m3: how far scaled-mm is from dequant
            fp8_linear.set_matmul(model, "dequant")
            rounding = max((a - b).abs().max().item() for a, b in zip(eager, model(x, t=t, **cond)))
            fp8_linear.set_matmul(model, matmul)
        compile_blocks.apply(wan, torch.float32)
        try:
            counters.clear()
            compiled = model(x, t=t, **cond)  # fullgraph: a break inside the block would raise
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
        finally:
            compile_blocks.restore(wan)
    diff = max((a - b).abs().max().item() for a, b in zip(eager, compiled))
    if matmul == "dequant":
        assert diff <= FORWARD_BOUND, diff
    else:
        # compiling reorders float32 sums before an activation is rounded to e4m3 (3 mantissa bits):
        # an input one ulp apart can round one fp8 step apart. Bound: less than the activation
        # rounding itself moves the output (measured 5.7e-3 against 1.8e-2 on this DiT)
        assert diff < rounding / 2, (diff, rounding)


@pytest.mark.slow(seconds=150)
def test_compiled_fp8_ranks_are_within_the_bound_of_eager(tiny_assets, inductor_cache, fp8_one_clip, tmp_path):
    """Real ranks: ulysses with CFG-parallel at 2 ranks, --compile --dit-quant fp8, within
    test_compile's frames bound of one process's eager fp8 frames."""
    from tests.test_compile import FRAMES_BOUND
    want = fp8_one_clip
    d = tmp_path / "run"
    d.mkdir()
    r = run_cli(["run", *TINY_FLAGS, *asset_flags(tiny_assets), "--num-clips", "1", "--nproc", "2", "--cfg-parallel",
                 "--compile", "--dit-quant", "fp8", "--output", str(d / "o.mp4"), "--frames-out", str(d / "f.pt"),
                 "--runs-root", str(d / "runs")], cwd=d, env=inductor_cache)
    assert r.returncode == 0, r.output
    diff = (torch.load(d / "f.pt") - want).abs().max().item()
    assert diff <= FRAMES_BOUND, diff


@pytest.mark.slow(seconds=60)
def test_a_batch_with_an_fp8_file_equals_one_process_per_job(tiny_assets, tmp_path):
    """--dit-file and --dit-quant are group settings: a batch group loads the fp8 file once and
    each job's frames equal one process's with them; a resume refuses a run made without fp8."""
    from wan_s2v_runner.shared import resume
    from wan_s2v_runner.shared.spec import RunSpec
    fp8 = tmp_path / "fp8.safetensors"
    fp8_file(dir_tensors(tiny_assets.ckpt_dir), fp8, "scale_weight", prefix=COMFY)
    with cpu_engine(tiny_assets) as engine:
        want = {seed: one_process_frames(engine, dit_quant=DitQuant.FP8, dit_file=fp8, num_clips=1, seed=seed)
                for seed in (42, 7)}
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"s{seed}", "seed": seed, "frames_out": str(tmp_path / f"{seed}.pt")})
                            + "\n" for seed in want))
    r = run_cli(["batch", str(jobs), *TINY_FLAGS, *asset_flags(tiny_assets), "--num-clips", "1", "--dit-file", str(fp8),
                 "--dit-quant", "fp8", "--output-dir", str(tmp_path / "out"), "--runs-root", str(tmp_path / "runs")],
                cwd=tmp_path)
    assert r.returncode == 0, r.output
    for seed, frames in want.items():
        assert torch.equal(torch.load(tmp_path / f"{seed}.pt"), frames), seed
    base = dict(ckpt_dir=tiny_assets.ckpt_dir, image=tiny_assets.image, audio=tiny_assets.audio, prompt="p")
    assert resume.spec_digest(RunSpec(**base)) != resume.spec_digest(RunSpec(**base, dit_quant="fp8"))
    plain = resume.spec_digest(RunSpec(**base, dit_quant="fp8", fp8_matmul="dequant"))
    assert plain == resume.spec_digest(RunSpec(**base, dit_quant="fp8"))  # a run made before the flag matches
    assert plain != resume.spec_digest(RunSpec(**base, dit_quant="fp8", fp8_matmul="scaled-mm"))


def test_non_finite_weights_are_refused_and_file_scales_need_no_read(ckpt, tmp_path):
    """A NaN in a weight to quantize is refused with its name, whole or by slices (where every rank
    refuses alike); the scales of an e4m3 file's weights are there even for a rank that read none."""
    from safetensors.torch import save_file
    t = dir_tensors(ckpt)
    bad = dict(t)
    w = t["blocks.1.ffn.0.weight"].clone()
    w[3, 5] = float("nan")
    bad["blocks.1.ffn.0.weight"] = w
    path = tmp_path / "nan.safetensors"
    save_file(bad, str(path))
    names = targets(t)
    with Fp8Source(ckpt_read.DitFileSource(path), names) as src:
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        with pytest.raises(ValueError, match="blocks.1.ffn.0.weight holds NaN"):
            src.read_flat(quantized_name("blocks.1.ffn.0.weight"), 0, q.view(-1))
    with Fp8Source(ckpt_read.DitFileSource(path), names) as src:
        src.measure([(quantized_name("blocks.1.ffn.0.weight"), 100, torch.empty(200, dtype=torch.float8_e4m3fn))])
        with pytest.raises(ValueError, match="NaN or infinite"):
            src.agree_scales(torch.device("cpu"))
    fp8 = tmp_path / "fp8.safetensors"
    fp8_file(t, fp8, "scale_weight")
    with Fp8Source(ckpt_read.DitFileSource(fp8), names) as src:
        src.agree_scales(torch.device("cpu"))  # no slice read at all
        assert set(src.row_scales()) == set(names)


def test_a_pool_recorded_before_fp8_keeps_its_identity():
    """The fleet's frame-deciding settings name fp8 and compile only when set: the identity of a
    default group is what it was before these settings existed."""
    from wan_s2v_runner.serve.fleet import frame_settings
    from wan_s2v_runner.shared.spec import GroupSpec
    plain = frame_settings(GroupSpec(ckpt_dir="/x", device="cpu"))
    assert "dit_quant" not in plain and "compile" not in plain
    both = frame_settings(GroupSpec(ckpt_dir="/x", device="cpu", dit_quant="fp8", compile=True))
    assert both["dit_quant"] == "fp8" and both["compile"] is True and "fp8_matmul" not in both
    mm = frame_settings(GroupSpec(ckpt_dir="/x", device="cpu", dit_quant="fp8", fp8_matmul="scaled-mm"))
    assert mm["fp8_matmul"] == "scaled-mm"


def test_scaled_mm_is_a_linear_within_fp8s_rounding_and_token_by_token():
    """``--fp8-matmul scaled-mm``'s Linear: within e4m3's rounding of both operands of the
    dequantizing Linear (fp32 and bf16 autocast, with and without a bias), the bf16 result in
    autocast's dtype, and a token's output unchanged by the other tokens' values (per-token
    activation scales: what lets sequence-parallel ranks equal one process)."""
    from patches import fp8_linear
    from wan_s2v_runner.loading.quantize import quantize_tensor
    torch.manual_seed(0)
    w, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(3, 40, 64)
    qw = Fp8Weight(96, 64)
    q, scale = quantize_tensor(w)
    qw.weight, qw.scale = torch.nn.Parameter(q, requires_grad=False), scale
    for b in (None, bias):
        deq = torch.nn.functional.linear(x, qw(torch.float32), b)
        got = fp8_linear.scaled_mm_linear(x, qw, b)
        assert got.shape == deq.shape and got.dtype == torch.float32
        rel = (got - deq).abs().max() / deq.abs().max()
        assert 0 < rel < 0.05, rel  # e4m3 keeps 3 mantissa bits: 2^-4 relative per operand
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fp8_linear.scaled_mm_linear(x, qw, bias)
        deq = torch.nn.functional.linear(x, qw(torch.float32), bias)
    assert got.dtype == torch.bfloat16
    rel = (got.float() - deq.float()).abs().max() / deq.float().abs().max()
    assert 0 < rel < 0.05, rel
    other = x.clone()
    other[:, 20:] *= 1000  # other tokens' magnitudes change; token 0-19's scales and values do not
    a, b = fp8_linear.scaled_mm_linear(x, qw, bias), fp8_linear.scaled_mm_linear(other, qw, bias)
    assert torch.equal(a[:, :20], b[:, :20]) and not torch.equal(a[:, 20:], b[:, 20:])


def test_fp8_matmul_is_chosen_by_one_rule_and_refused_on_an_old_gpu():
    """The rule (run and doctor share it), the flag's own validation, and the preflight on
    recorded machines: ``scaled-mm`` on an A100 (cc 8.0) or a V100 is refused with the fix before
    any rank starts; on an L40S (8.9) and an H100 (9.0) it runs; never chosen for the user, the
    doctor names it for a compiled run where it measured faster."""
    from pathlib import Path

    from pydantic import ValidationError

    from wan_s2v_runner.preflight import CheckContext, MachineFacts, Status, run_checks
    from wan_s2v_runner.preflight.core import find
    from wan_s2v_runner.shared.quant import Fp8Matmul, Fp8MatmulUnavailable, choose_fp8_matmul
    from wan_s2v_runner.shared.spec import GroupSpec
    assert choose_fp8_matmul("dequant", "cuda", (9, 0))[0] is Fp8Matmul.DEQUANT
    assert choose_fp8_matmul("scaled-mm", "cuda", (8, 9))[0] is Fp8Matmul.SCALED_MM
    assert choose_fp8_matmul("scaled-mm", "cpu", None)[0] is Fp8Matmul.SCALED_MM
    for cc in ((8, 6), (8, 0), None):
        with pytest.raises(Fp8MatmulUnavailable, match="compute capability >= 8.9"):
            choose_fp8_matmul("scaled-mm", "cuda", cc)
    with pytest.raises(ValidationError, match="add --dit-quant fp8"):
        GroupSpec(ckpt_dir="/x", fp8_matmul="scaled-mm")
    assert GroupSpec(ckpt_dir="/x").fp8_matmul is Fp8Matmul.DEQUANT
    machines = Path(__file__).parent / "data" / "machines"

    def check(machine, **kw):
        facts = MachineFacts.load(machines / f"{machine}.json")
        vals = dict(device="cuda", nproc=1, dit_quant="fp8", **kw)
        return find(run_checks(CheckContext.for_values(vals, facts), ["gpus"]), "gpus.fp8_matmul")

    for machine in ("a100_8x_nvlink", "v100s_2x_pcie"):
        r = check(machine, fp8_matmul="scaled-mm")
        assert r.status is Status.FAIL and "compute capability >= 8.9" in r.finding, r.finding
        assert "--fp8-matmul dequant" in r.fix
        assert check(machine).status is Status.OK  # the default, dequant, runs anywhere
        assert "scaled-mm would be faster" not in check(machine, compile=True).finding
    for machine in ("l40s_1x", "h100_1x"):
        r = check(machine, fp8_matmul="scaled-mm")
        assert r.status is Status.OK and r.finding.startswith("--fp8-matmul scaled-mm"), r.finding
    assert check("h100_1x").finding.startswith("--fp8-matmul dequant")
    assert "scaled-mm would be faster" not in check("h100_1x").finding  # eager: it is not
    assert "scaled-mm would be faster" in check("h100_1x", compile=True).finding
    r = find(run_checks(CheckContext.for_values(dict(device="cuda", nproc=1),
                                                MachineFacts.load(machines / "h100_1x.json")), ["gpus"]),
             "gpus.fp8_matmul")
    assert r.status is Status.SKIP
