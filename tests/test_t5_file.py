"""``--t5-file``: the T5 text encoder from one safetensors file users already hold (ComfyUI's
``umt5_xxl_fp16``/``bf16``/``fp8_e4m3fn_scaled``).

The files are built here from the tiny checkpoint's T5 (``models_t5_umt5-xxl-enc-bf16.pth``, bf16)
in each form: (a) wan's own names, bf16 or fp32; (b) Hugging Face/ComfyUI names
(``comfy/text_encoders/t5.py``), with or without the tied ``encoder.embed_tokens`` copy; (c) ComfyUI's
scaled fp8 (float8_e4m3fn Linears, float32 ``scale_weight``, ``scaled_fp8`` marker) and its newer
``weight_scale``/``comfy_quant`` form. (a) and (b) load the checkpoint's T5 exactly (bf16 -> fp32 is
exact); (c) loads exactly ``fp8.to(float32) * scale`` (then the T5's dtype), which is within the
e4m3 rounding bound of the original weight, elementwise::

    |w_hat - w| <= 2**-4 * |w| + 2**-10 * s          (s: the tensor's or row's scale, amax / 448)

e4m3 keeps 3 mantissa bits, so a normal value (|w / s| >= 2**-6) rounds to nearest within half an
ulp, 2**-4 of its magnitude; below that the subnormal spacing is 2**-9, half of it 2**-10 (times s).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import TINY_FLAGS, cpu_engine, one_process_frames, run_frames
from wan_s2v_runner.loading import lean_load, t5_file
from wan_s2v_runner.loading.dit_file import DitFileFormat
from wan_s2v_runner.preflight import CheckContext, Status, run_checks
from wan_s2v_runner.preflight.core import find
from wan_s2v_runner.preflight.probe import probe_machine
from wan_s2v_runner.shared.ckpt_layout import DIT_WEIGHTS, T5_FILE

E4M3_MAX = 448.0
LINEARS = ("attn.q", "attn.k", "attn.v", "attn.o", "ffn.gate.0", "ffn.fc1", "ffn.fc2")


def hf_name(name: str) -> str:
    """Hugging Face's UMT5 name of wan's tensor ``name``, written out here from ComfyUI's and
    transformers' module names (independently of the module under test): in both,
    ``DenseReluDense`` computes ``wo(gelu(wi_0(x)) * wi_1(x))``, wan ``fc2(fc1(x) * gelu(gate.0(x)))``."""
    if name == "token_embedding.weight":
        return "shared.weight"
    if name == "norm.weight":
        return "encoder.final_layer_norm.weight"
    i, rest = re.fullmatch(r"blocks\.(\d+)\.(.+)", name).groups()
    return f"encoder.block.{i}." + {
        "norm1.weight": "layer.0.layer_norm.weight",
        "attn.q.weight": "layer.0.SelfAttention.q.weight",
        "attn.k.weight": "layer.0.SelfAttention.k.weight",
        "attn.v.weight": "layer.0.SelfAttention.v.weight",
        "attn.o.weight": "layer.0.SelfAttention.o.weight",
        "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
        "norm2.weight": "layer.1.layer_norm.weight",
        "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
        "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
        "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
    }[rest]


def is_linear(name: str) -> bool:
    return name.endswith(tuple(f"{m}.weight" for m in LINEARS))


def fp8_file(sd: dict, path: Path, form: str) -> dict[str, torch.Tensor]:
    """``sd`` (wan names) as a ComfyUI fp8 T5 file under Hugging Face names: the Linears in
    float8_e4m3fn, ``scale_weight`` (one float32 per tensor, the ``scaled_fp8`` marker, an unused
    ``scale_input``) or ``weight_scale`` (one per row, a ``comfy_quant`` record); the rest as
    stored. Returns (wan names) each weight's scale, [1] or [rows, 1]."""
    out, scales = {}, {}
    for name, t in sd.items():
        key = hf_name(name)
        if not is_linear(name):
            out[key] = t
            continue
        w = t.float()
        amax = w.abs().amax(dim=1, keepdim=True) if form == "weight_scale" else w.abs().amax().reshape(1)
        s = (amax / E4M3_MAX).float()
        out[key], scales[name] = (w / s).to(torch.float8_e4m3fn), s
        module = key.removesuffix(".weight")
        if form == "scale_weight":
            out[f"{module}.scale_weight"], out[f"{module}.scale_input"] = s, torch.ones(1)
        else:
            out[f"{module}.weight_scale"] = s
            out[f"{module}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                        dtype=torch.uint8)
    if form == "scale_weight":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))
    return scales


def by_hand(path: Path, scales: dict, names) -> dict[str, torch.Tensor]:
    """The fp8 file's tensors ``names`` (wan's) dequantized here: ``fp8.float() * scale`` (fp32)."""
    from safetensors.torch import load_file
    raw = load_file(str(path))
    return {n: raw[hf_name(n)].float() * scales[n] if n in scales else raw[hf_name(n)].float() for n in names}


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine(tiny_assets):
    with cpu_engine(tiny_assets) as e:
        yield e


@pytest.fixture(scope="module")
def t5_sd(tiny_assets) -> dict[str, torch.Tensor]:
    """The checkpoint's T5 state dict (wan names, bf16)."""
    return torch.load(tiny_assets.ckpt_dir / T5_FILE, weights_only=True)


def load_t5(engine, assets, path=None):
    """The T5EncoderModel a rank loads (``components._lean_t5``, one private copy), from the
    checkpoint's ``.pth`` or from ``path`` (``--t5-file``); its load report's strategy."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.shared.layout import Layout, Mode
    wan, cfg, _ = engine
    report = lean_load.LoadReport()
    te = components._lean_t5(wan, cfg, str(assets.ckpt_dir), Layout.for_mode(Mode.ULYSSES, 1), None, report,
                             lambda *a, **k: None, t5_file=path)
    return te, report.strategy


def encode(te, prompt="a person talking, then a pause"):
    with torch.no_grad():
        return te([prompt], torch.device("cpu"))[0]


@pytest.fixture(scope="module")
def reference(engine, tiny_assets):
    """The checkpoint's T5 (from its .pth): its state dict and a prompt's encoding."""
    te, _ = load_t5(engine, tiny_assets)
    return te.model.state_dict(), encode(te)


# --------------------------------------------------------------------------- the mapping
def test_the_mapping_names_every_tensor_of_the_engines_encoder(engine, t5_sd):
    """The module's expected tensors are the engine's ``T5Encoder``'s (names and shapes, built on
    meta from the file's dims), and its Hugging Face mapping is the one written out here."""
    wan, cfg, _ = engine
    dims = t5_file.t5_dims({k: tuple(v.shape) for k, v in t5_sd.items()})
    model = t5_file.empty_t5(wan, dims, torch.float32)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == t5_file.expected_shapes(dims)
    for name in t5_sd:
        assert t5_file.to_hf(name) == hf_name(name)
        assert t5_file.hf_module(hf_name(name).removesuffix(".weight")) + ".weight" == name


def test_hugging_face_umt5_computes_what_the_mapped_wan_encoder_computes(engine, tiny_assets, tmp_path, t5_sd):
    """transformers' own UMT5 encoder, given the Hugging Face-named file, encodes a prompt as
    wan's encoder loaded through ``--t5-file`` does (fp32, to float rounding): the names mean
    the same weights (wi_0 is the GELU'd gate). Swapping wi_0 and wi_1 changes the encoding."""
    from transformers import UMT5Config, UMT5EncoderModel
    hf = {hf_name(k): v for k, v in t5_sd.items()}
    path = tmp_path / "umt5_xxl_bf16.safetensors"
    save_file(hf, str(path))
    te, _ = load_t5(engine, tiny_assets, path)
    d = t5_file.t5_dims({k: tuple(v.shape) for k, v in t5_sd.items()})
    config = UMT5Config(vocab_size=d["vocab_size"], d_model=d["dim"], d_kv=d["dim_attn"] // d["num_heads"],
                        d_ff=d["dim_ffn"], num_layers=d["num_layers"], num_heads=d["num_heads"],
                        relative_attention_num_buckets=d["num_buckets"], relative_attention_max_distance=128,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6)
    ids, mask = te.tokenizer(["a person talking, then a pause"], return_mask=True, add_special_tokens=True)
    n = int(mask.sum())
    want = encode(te)

    def hf_encoding(weights):
        model = UMT5EncoderModel(config).eval()
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)  # embed_tokens: tied
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).last_hidden_state[0, :n]

    torch.testing.assert_close(hf_encoding(hf), want, rtol=1e-5, atol=1e-5)
    wi = "encoder.block.0.layer.1.DenseReluDense.wi_{}.weight"
    swapped = {**hf, wi.format(0): hf[wi.format(1)], wi.format(1): hf[wi.format(0)]}
    assert (hf_encoding(swapped) - want).abs().max() > 1e-2


# --------------------------------------------------------------------------- (a), (b): exact
@pytest.mark.parametrize("naming,dtype,tied", [
    ("wan", torch.bfloat16, False),
    ("wan", torch.float32, False),
    ("hf", torch.bfloat16, False),
    ("hf", torch.float32, True),
])
def test_full_precision_files_load_the_checkpoints_t5_exactly(engine, tiny_assets, reference, t5_sd, tmp_path,
                                                                naming, dtype, tied):
    """Wan or Hugging Face names, bf16 (the .pth's dtype) or fp32, with Hugging Face's tied
    embedding copy or without: the same state dict, to the bit, and the same encoding."""
    tensors = {(hf_name(k) if naming == "hf" else k): v.to(dtype) for k, v in t5_sd.items()}
    if tied:
        tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"].clone()
    tensors["spiece_model"] = torch.tensor(list(b"tokenizer bytes"), dtype=torch.uint8)  # ComfyUI's record
    path = tmp_path / "umt5_xxl.safetensors"
    save_file(tensors, str(path))
    layout = t5_file.inspect(path)
    assert layout.format is DitFileFormat.FULL
    assert layout.naming == (t5_file.HF if naming == "hf" else t5_file.WAN)
    assert "spiece_model" in layout.ignored and (("encoder.embed_tokens.weight" in layout.ignored) == tied)
    te, strategy = load_t5(engine, tiny_assets, path)
    want_sd, want_encoding = reference
    got = te.model.state_dict()
    assert got.keys() == want_sd.keys()
    for k in want_sd:
        assert torch.equal(got[k], want_sd[k]), k
    assert torch.equal(encode(te), want_encoding)
    assert "umt5_xxl.safetensors: full precision" in strategy["t5_file"]


# --------------------------------------------------------------------------- (c): fp8
@pytest.mark.parametrize("form,fmt", [("scale_weight", DitFileFormat.SCALED_FP8),
                                      ("weight_scale", DitFileFormat.COMFY_QUANT)])
def test_scaled_fp8_files_load_their_dequantized_values(engine, tiny_assets, reference, t5_sd, tmp_path, form, fmt):
    """ComfyUI's scaled fp8 (per-tensor ``scale_weight`` + marker, or per-row ``weight_scale`` +
    ``comfy_quant``): the T5 holds exactly ``fp8.float() * scale`` (fp32 on the CPU), within the
    e4m3 bound of the checkpoint's weights (module docstring), and encodes exactly as a T5 of those
    values from a full-precision file."""
    path = tmp_path / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
    scales = fp8_file(t5_sd, path, form)
    layout = t5_file.inspect(path)
    assert layout.format is fmt and set(layout.scales) == set(scales) and len(scales) == 7
    te, strategy = load_t5(engine, tiny_assets, path)
    got, hand = te.model.state_dict(), by_hand(path, scales, t5_sd)
    assert got.keys() == hand.keys() == reference[0].keys()
    worst = 0.0
    for name, w in t5_sd.items():
        assert torch.equal(got[name], hand[name]), name
        if name not in scales:
            assert torch.equal(got[name], w.float()), name
            continue
        w = w.float()
        bound = 2.0 ** -4 * w.abs() + 2.0 ** -10 * scales[name]
        err = (got[name] - w).abs()
        assert (err <= bound).all(), (name, float((err - bound).max()))
        worst = max(worst, float((err / bound).max()))
    assert 0.5 < worst <= 1.0  # the quantization is real, and the bound is reached, not loose
    values = tmp_path / "dequantized.safetensors"
    save_file({k: v.contiguous() for k, v in hand.items()}, str(values))
    dequantized, _ = load_t5(engine, tiny_assets, values)
    assert torch.equal(encode(te), encode(dequantized))
    assert not torch.equal(encode(te), reference[1])
    assert fmt.value in strategy["t5_file"]


def test_fp8_slices_read_as_whole_tensors_do(t5_sd, tmp_path):
    """FSDP shards cut a weight anywhere: slices starting and ending inside rows read exactly the
    elements of the whole dequantized tensor (per-row scales)."""
    from wan_s2v_runner.loading.ckpt_read import ReadCounter
    path = tmp_path / "umt5_fp8.safetensors"
    scales = fp8_file(t5_sd, path, "weight_scale")
    hand = by_hand(path, scales, t5_sd)
    counter = ReadCounter()
    with t5_file.open_t5_file(path, counter) as src:
        assert set(src.table()) == set(t5_sd)
        name = "blocks.0.ffn.fc2.weight"  # [4096, 64]
        for start, n in ((0, 64), (5, 70), (63, 1), (100, 4000), (4096 * 64 - 3, 3)):
            part = torch.empty(n)
            src.read_flat(name, start, part)
            assert torch.equal(part, hand[name].reshape(-1)[start:start + n]), (start, n)
    assert counter.total > 0


# --------------------------------------------------------------------------- preflight
def ctx(assets, t5, ckpt=None, **kw):
    root = Path(t5).parent if t5 else Path(assets.ckpt_dir).parent
    vals = dict(ckpt_dir=ckpt or assets.ckpt_dir, image=assets.image, audio=assets.audio, prompt="a person talking",
                device="cpu", nproc=1, max_area=64 * 64, infer_frames=8, mode="ulysses",
                output=root / "out" / "x.mp4", t5_file=t5, **kw)
    return CheckContext.for_values(vals, probe_machine())


def t5_check(assets, path, **kw):
    return find(run_checks(ctx(assets, path, **kw), ["checkpoint"]), "ckpt.t5_file")


def test_a_good_file_passes_and_stands_in_for_the_pth(tiny_assets, t5_sd, tmp_path):
    """With --t5-file, CKPT_DIR needs no T5 .pth: every checkpoint check passes, the sub-model
    checks (DiT text width, tokenizer vocabulary) and the memory plan read the file's table."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_assets.ckpt_dir, ckpt)
    (ckpt / T5_FILE).unlink()
    path = tmp_path / "umt5 xxl fp8 'scaled'.safetensors"
    fp8_file(t5_sd, path, "scale_weight")
    c = ctx(tiny_assets, path, ckpt=ckpt)
    results = run_checks(c, ["checkpoint"])
    bad = [(r.id, r.finding) for r in results if r.status not in (Status.OK, Status.SKIP)]
    assert bad == []
    r = find(results, "ckpt.t5_file")
    assert r.status is Status.OK, r.finding
    assert "ComfyUI scaled fp8 (scale_weight)" in r.finding and "Hugging Face/ComfyUI names" in r.finding
    assert "dim 4096, 1 layer, 4 heads" in r.finding
    assert "T5's weights come from --t5-file" in find(results, "ckpt.files").finding
    assert "T5 width 4096" in find(results, "ckpt.submodels").finding
    from wan_s2v_runner.preflight.memory import model_sizes
    assert model_sizes(c).t5_params == sum(v.numel() for v in t5_sd.values())
    assert t5_check(tiny_assets, None).status is Status.SKIP


def _blocks(sd: dict, n: int) -> dict:
    """``sd`` with its one block repeated as blocks 0..n-1."""
    out = {k: v for k, v in sd.items() if not k.startswith("blocks.")}
    for i in range(n):
        out.update({k.replace("blocks.0.", f"blocks.{i}.", 1): v.clone() for k, v in sd.items()
                    if k.startswith("blocks.0.")})
    return out


@pytest.mark.parametrize("case,needle", [
    ("renamed", "is not a UMT5-XXL encoder: it holds 1 tensor no UMT5 encoder has "
                "(encoder.block.0.layer.1.DenseReluDense.gate.weight)"),
    ("missing", "is not a UMT5-XXL encoder: it lacks 1 tensor of one (encoder.block.0.layer.1.DenseReluDense.wi_1"),
    ("wrong_shape", "encoder.block.0.layer.1.DenseReluDense.wo.weight has shape [64, 4096]"),
    ("truncated", "truncated"),
    ("ungated", "its feed-forward is ungated (DenseReluDense.wi), an original T5's"),
    ("t5_v1_1", "only block 0 has a relative_attention_bias (a T5 v1.1 encoder"),
    ("layers", f"it has num_layers 2, CKPT_DIR's {T5_FILE} 1: another model's text encoder"),
    ("dit", "is a Wan DiT, not the T5 text encoder"),
    ("mixed", "its names mix Hugging Face's"),
    ("clip", "lacks the encoder's tensors"),
    ("pth", "is not a .safetensors file"),
    ("nvfp4", "quantized as 'nvfp4'; fp8 format not recognised"),
    ("load_full", "--t5-file is read by lean loading"),
])
def test_preflight_refuses_a_file_it_cannot_use(tiny_assets, t5_sd, tmp_path, case, needle):
    """Each refusal names the cause (one line) and a fix, before anything spawns."""
    hf = {hf_name(k): v for k, v in t5_sd.items()}
    path, kw = tmp_path / "umt5.safetensors", {}
    wi = "encoder.block.0.layer.1.DenseReluDense.wi_{}.weight"
    if case == "renamed":
        save_file({**{k: v for k, v in hf.items() if k != wi.format(0)},
                   "encoder.block.0.layer.1.DenseReluDense.gate.weight": hf[wi.format(0)]}, str(path))
    elif case == "missing":
        save_file({k: v for k, v in hf.items() if k != wi.format(1)}, str(path))
    elif case == "wrong_shape":
        wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
        save_file({**hf, wo: hf[wo].t().contiguous()}, str(path))
    elif case == "truncated":
        save_file(hf, str(path))
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "ungated":
        save_file({**{k: v for k, v in hf.items() if "wi_" not in k},
                   "encoder.block.0.layer.1.DenseReluDense.wi.weight": hf[wi.format(0)]}, str(path))
    elif case == "t5_v1_1":
        two = {hf_name(k): v for k, v in _blocks(t5_sd, 2).items()}
        del two["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"]
        save_file(two, str(path))
    elif case == "layers":
        save_file({hf_name(k): v for k, v in _blocks(t5_sd, 2).items()}, str(path))
    elif case == "dit":
        shutil.copy(tiny_assets.ckpt_dir / DIT_WEIGHTS, path)
    elif case == "mixed":
        save_file({**hf, "blocks.0.norm1.weight": t5_sd["blocks.0.norm1.weight"].clone()}, str(path))
    elif case == "clip":
        save_file({"text_model.encoder.layers.0.mlp.fc1.weight": torch.zeros(4, 4)}, str(path))
    elif case == "pth":
        path = tiny_assets.ckpt_dir / T5_FILE
    elif case == "nvfp4":
        fp8_file(t5_sd, path, "weight_scale")
        from safetensors.torch import load_file
        raw = load_file(str(path))
        key = next(k for k in raw if k.endswith(".comfy_quant"))
        raw[key] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
        save_file(raw, str(path))
    else:  # load_full
        save_file(hf, str(path))
        kw = {"load": "full"}
    r = t5_check(tiny_assets, path, **kw)
    assert r.status is Status.FAIL, r.finding
    assert needle in r.finding, r.finding
    assert "\n" not in r.finding and r.fix and "\n" not in r.fix


def test_full_loading_refuses_a_t5_file(engine, tiny_assets):
    """``--load full`` is upstream's reading of CKPT_DIR: the loader refuses --t5-file there too."""
    from wan_s2v_runner.loading import components
    from wan_s2v_runner.rank.parallel import RankPlan
    from wan_s2v_runner.shared.layout import Layout, Mode
    wan, cfg, _ = engine
    with pytest.raises(ValueError, match="--t5-file is read by lean loading only"):
        components.load(wan, cfg, str(tiny_assets.ckpt_dir), RankPlan(Layout.for_mode(Mode.ULYSSES, 1), 0),
                        torch.device("cpu"), 0, components.LoadSettings(strategy="full", t5_file=Path("/x.sft")))


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow(seconds=60)
def test_a_run_with_a_t5_file_makes_the_same_frames(engine, tiny_assets, t5_sd, tmp_path):
    """A real 1-rank CPU run (``wan-s2v run --t5-file``, wan names, bf16) on a checkpoint directory
    without the T5 .pth makes exactly the frames of the same run reading the .pth (our loop in
    this process, the frames a ``--nproc 1`` run writes)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_assets.ckpt_dir, ckpt)
    (ckpt / T5_FILE).unlink()
    path = tmp_path / "umt5_xxl_bf16.safetensors"
    save_file(t5_sd, str(path))
    want = one_process_frames(engine, num_clips=1)
    assets = SimpleNamespace(ckpt_dir=ckpt, image=tiny_assets.image, audio=tiny_assets.audio)
    got, run_dir = run_frames(assets, tmp_path / "run", [*TINY_FLAGS, "--num-clips", "1"], "--t5-file", str(path))
    assert torch.equal(got, want)
    assert "umt5_xxl_bf16.safetensors: full precision, Wan names" in (run_dir / "events" / "rank0.jsonl").read_text()
