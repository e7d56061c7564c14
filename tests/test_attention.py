"""patches/attention.py: SDPA == flash-attn varlen semantics; apply() reroutes Wan on CPU."""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from patches import attention as pa
from patches.attention import apply, resolve_backend, sdpa_attention
from wan_s2v_runner.loading.engine import import_wan
from wan_s2v_runner.preflight.facts import MachineFacts
from wan_s2v_runner.shared.attention_backends import (
    BackendUnavailable,
    choose_backend,
    describe_import_error,
    measure_availability,
)

MACHINES = Path(__file__).parent / "data" / "machines"


# ---------------------------------------------------------------- naive float64 reference
def ref_attention(q, k, v, q_lens=None, k_lens=None, softmax_scale=None, q_scale=None,
                  causal=False, window_size=(-1, -1)):
    """flash-attn varlen semantics, one item / head / query at a time, softmax in float64."""
    q, k, v = q.double(), k.double(), v.double()
    B, Lq, Nq, C1 = q.shape
    Lk, Nk, C2 = k.shape[1], k.shape[2], v.shape[3]
    scale = C1 ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    out = torch.zeros(B, Lq, Nq, C2, dtype=torch.float64)
    for b in range(B):
        sq = Lq if q_lens is None else min(int(q_lens[b]), Lq)
        sk = Lk if k_lens is None else min(int(k_lens[b]), Lk)
        for h in range(Nq):
            hk = h // (Nq // Nk)
            for i in range(sq):
                d = i + sk - sq  # bottom-right aligned diagonal
                keys = [j for j in range(sk)
                        if (not causal or j <= d)
                        and (left < 0 or j >= d - left)
                        and (right < 0 or j <= d + right)]
                if not keys:
                    continue  # flash-attn writes zeros
                qi = q[b, i, h] * (1.0 if q_scale is None else q_scale)
                s = torch.stack([(qi * k[b, j, hk]).sum() * scale for j in keys])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out[b, i, h] = sum(p[n] * v[b, j, hk] for n, j in enumerate(keys))
    return out


def rand(B=2, Lq=7, Lk=9, Nq=4, Nk=4, C1=8, C2=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(B, Lq, Nq, C1), mk(B, Lk, Nk, C1), mk(B, Lk, Nk, C2)


TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

CASES = {
    "plain": dict(),
    "plain_square": dict(shape=dict(Lq=9, Lk=9)),
    "k_lens_ragged": dict(kw=dict(k_lens=torch.tensor([9, 4]))),
    "k_lens_full": dict(kw=dict(k_lens=torch.tensor([9, 9]))),  # fast path: no mask
    "k_lens_over": dict(kw=dict(k_lens=torch.tensor([12, 3]))),  # clamped to Lk
    "q_lens_ragged": dict(kw=dict(q_lens=torch.tensor([7, 3]))),
    "q_and_k_lens": dict(kw=dict(q_lens=torch.tensor([5, 7]), k_lens=torch.tensor([2, 9]))),
    "scales": dict(kw=dict(q_scale=0.7, softmax_scale=0.3)),
    "causal_lq_lt_lk": dict(kw=dict(causal=True)),
    "causal_lq_gt_lk": dict(shape=dict(Lq=9, Lk=5), kw=dict(causal=True)),  # early rows empty
    "causal_ragged": dict(kw=dict(causal=True, q_lens=torch.tensor([4, 7]),
                                  k_lens=torch.tensor([9, 5]))),
    "window_left": dict(kw=dict(window_size=(2, -1))),
    "window_right": dict(kw=dict(window_size=(-1, 1))),
    "window_both": dict(kw=dict(window_size=(1, 2), k_lens=torch.tensor([6, 9]))),
    "window_causal": dict(kw=dict(window_size=(3, -1), causal=True)),
    "window_empty_rows": dict(shape=dict(Lq=9, Lk=4), kw=dict(window_size=(0, 0))),
    "gqa": dict(shape=dict(Nq=4, Nk=2), kw=dict(k_lens=torch.tensor([5, 9]), causal=True)),
    "gqa_plain": dict(shape=dict(Nq=4, Nk=1)),
    "v_dim_differs": dict(shape=dict(C2=5), kw=dict(k_lens=torch.tensor([3, 8]))),
    "k_len_zero": dict(kw=dict(k_lens=torch.tensor([0, 6]))),  # item 0: no keys at all
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_matches_reference(case, dtype):
    spec = CASES[case]
    q, k, v = rand(dtype=dtype, **spec.get("shape", {}))
    kw = spec.get("kw", {})
    out = sdpa_attention(q, k, v, **kw)
    ref = ref_attention(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_padded_query_rows_are_zero():
    q, k, v = rand()
    out = sdpa_attention(q, k, v, q_lens=torch.tensor([7, 3]), k_lens=torch.tensor([9, 5]))
    assert out[1, 3:].abs().max() == 0
    assert out[1, :3].abs().min() > 0 and out[0].abs().min() > 0


def test_fully_masked_rows_give_zeros_not_nan():
    q, k, v = rand(Lq=6, Lk=3)
    out = sdpa_attention(q, k, v, causal=True)  # rows 0..2: i + 3 - 6 < 0 -> no key
    assert not out.isnan().any()
    assert out[:, :3].abs().max() == 0 and out[:, 3:].abs().min() > 0
    out = sdpa_attention(q, k, v, k_lens=torch.tensor([0, 0]))
    assert out.abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_dtype_follows_q(dtype):
    q, k, v = rand(dtype=dtype)
    out = sdpa_attention(q, k, v, k_lens=torch.tensor([9, 5]))
    assert out.dtype == dtype
    ref = ref_attention(q, k, v, k_lens=torch.tensor([9, 5]))
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    # mixed input dtypes: computed in the promoted dtype, returned in q's dtype
    out = sdpa_attention(q, k.float(), v.double())
    assert out.dtype == dtype


def test_gqa_rejects_indivisible_heads():
    q, k, v = rand(Nq=3, Nk=2)
    with pytest.raises(ValueError, match="divisible"):
        sdpa_attention(q, k, v)


# ---------------------------------------------------------------- backend choice
def test_resolve_backend_cpu():
    backend, reason = resolve_backend("auto", "cpu")
    assert backend == "sdpa" and "cpu" in reason
    assert resolve_backend("sdpa", "cpu")[0] == "sdpa"
    assert resolve_backend("SDPA", "cuda")[0] == "sdpa"
    for req in ("fa2", "fa3"):
        with pytest.raises(RuntimeError, match=r"Fix: .*--attention sdpa"):
            resolve_backend(req, "cpu")
    with pytest.raises(ValueError):
        resolve_backend("xformers", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_resolve_backend_cuda_without_gpu_falls_back():
    backend, reason = resolve_backend("auto", "cuda")
    assert backend == "sdpa" and "no usable flash-attn" in reason
    with pytest.raises(RuntimeError, match=r"flash-attn 2 .* not usable: .*Fix: pip install"):
        resolve_backend("fa2", "cuda")


def test_abi_mismatch_reason_names_symbol():
    err = ImportError("/x/flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
    why = describe_import_error(err)
    assert "ABI mismatch" in why and "_ZN3c104cuda9SetDeviceEi" in why



def _recorded(name: str) -> tuple[MachineFacts, str, object]:
    """(facts, device type, lowest GPU compute capability) of a recorded machine."""
    f = MachineFacts.load(MACHINES / f"{name}.json")
    cc = min((tuple(g["capability"]) for g in f.gpus), default=None)
    return f, "cuda" if f.gpu_count else "cpu", cc


@pytest.mark.parametrize("name", sorted(p.stem for p in MACHINES.glob("*.json")))
def test_choose_backend_reproduces_what_each_recorded_probe_picked(name):
    f, device, cc = _recorded(name)
    auto = f.attention["auto"]
    assert choose_backend("auto", device, f.attention, cc) == (auto["backend"], auto["reason"])


def test_choose_backend_on_recorded_machines():
    h100, dev, cc = _recorded("h100_1x")
    assert (dev, cc) == ("cuda", (9, 0))
    backend, reason = choose_backend("auto", dev, h100.attention, cc)
    assert backend == "fa2" and "2.8.3 imports and runs" in reason  # no FA3 installed there
    assert choose_backend("fa2", dev, h100.attention, cc)[0] == "fa2"
    assert choose_backend("auto", "cpu", h100.attention, cc)[0] == "sdpa"  # --device cpu on it
    with pytest.raises(BackendUnavailable, match=r"flash-attn 3 .* is not usable: not installed. Fix: build FA3"):
        choose_backend("fa3", dev, h100.attention, cc, torch_version="2.8.0+cu128")
    # FA3 usable there -> auto prefers it.
    with_fa3 = copy.deepcopy(h100.attention)
    with_fa3["fa3"] = {"installed": "3.0.0b1", "usable": True, "reason": "FA3 runs"}
    assert choose_backend("auto", dev, with_fa3, cc) == ("fa3", "FA3 runs")

    v100, dev, cc = _recorded("v100s_2x_pcie")
    assert (dev, cc) == ("cuda", (7, 0))
    assert choose_backend("auto", dev, v100.attention, cc) == (
        "sdpa", "no usable flash-attn (fa3: not installed; fa2: not installed)")
    with pytest.raises(BackendUnavailable, match=r"flash-attn 2 .* not usable: not installed.*CUDA 12"):
        choose_backend("fa2", dev, v100.attention, cc, torch_version="2.5.1", cuda_version="12.4")
    # Even a flash-attn that imports and runs is refused below its compute capability.
    usable = {b: {"installed": "x", "usable": True, "reason": f"{b} runs"} for b in ("fa3", "fa2")}
    backend, reason = choose_backend("auto", dev, usable, cc)
    assert backend == "sdpa" and "fa2: needs compute capability >= 8.0, the GPU has 7.0" in reason
    with pytest.raises(BackendUnavailable, match=r"needs compute capability 9.0 \(Hopper\), the GPU has 8.0"):
        choose_backend("fa3", "cuda", usable, (8, 0))
    assert choose_backend("auto", "cuda", usable, (8, 9)) == ("fa2", "fa2 runs")
    assert choose_backend("auto", "cuda", usable, (9, 0)) == ("fa3", "fa3 runs")


def test_broken_flash_attn_is_measured_as_an_abi_mismatch(tmp_path, monkeypatch):
    """A flash_attn whose import fails with 'undefined symbol' (a wheel for another torch): the
    measurement says so before and after the pre-import guard parks it, and auto avoids it."""
    import wan_s2v_runner.shared.attention_backends as ab

    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("/x/flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ab, "_IMPORT_FAILURES", {})
    assert "flash_attn" not in sys.modules
    ab._measure.cache_clear()
    try:
        fa2 = ab.measure_availability("cuda")["fa2"]
        assert fa2["installed"] == "unknown" and fa2["usable"] is False
        assert fa2["import_error"].startswith("ImportError: ") and "_ZN3c104cuda9SetDeviceEi" in fa2["import_error"]
        assert fa2["reason"] == ("ABI mismatch: its CUDA extension was built for another torch "
                                 "(undefined symbol _ZN3c104cuda9SetDeviceEi)")
        assert ab.guard_flash_attn_imports() == {"flash_attn": fa2["reason"]}
        assert sys.modules["flash_attn"] is None  # parked: upstream's import now sees "absent"
        ab._measure.cache_clear()
        assert ab.measure_availability("cuda")["fa2"] == fa2  # still "broken", not "not installed"
        backend, reason = ab.choose_backend("auto", "cuda", ab.measure_availability("cuda"), (8, 0))
        assert backend == "sdpa" and "fa2: ABI mismatch" in reason
    finally:
        sys.modules.pop("flash_attn", None)
        ab._measure.cache_clear()


def test_live_choice_is_choose_backend_on_the_live_measurement():
    """resolve_backend (the patch) == choose_backend on measure_availability, on this machine."""
    cc = (torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    for device in ("cpu", "cuda"):
        avail = measure_availability(device)
        assert set(avail) == {"fa3", "fa4", "fa2"}
        assert all({"installed", "usable", "reason", "import_error"} <= set(r) for r in avail.values())
        for req in ("auto", "sdpa", "fa2", "fa3", "fa4"):
            try:
                want = choose_backend(req, device, avail, cc, torch_version=torch.__version__,
                                      cuda_version=torch.version.cuda)
            except BackendUnavailable as e:
                with pytest.raises(BackendUnavailable) as got:
                    resolve_backend(req, device)
                assert str(got.value) == str(e)
            else:
                assert resolve_backend(req, device) == want


# ---------------------------------------------------------------- rerouting the engine
@pytest.fixture(scope="module")
def wan():
    w = import_wan()
    yield w
    pa.restore(w)


def test_upstream_asserts_on_cpu(wan):
    orig = getattr(wan.modules.attention, pa._ORIG_FA_ATTR, wan.modules.attention.flash_attention)
    q, k, v = rand()
    with pytest.raises(AssertionError):
        orig(q, k, v)


def test_apply_reroutes_every_s2v_module(wan):
    patched = apply(wan, "sdpa")
    for name in pa.S2V_MODULES + ("wan.modules",):
        assert name in patched
        assert sys.modules[name].flash_attention is sdpa_attention, name
    assert wan.modules.s2v.model_s2v.flash_attention is sdpa_attention
    # no leftover binding of upstream's function anywhere in wan.*
    orig = getattr(wan.modules.attention, pa._ORIG_FA_ATTR)
    assert not [n for n, m in sys.modules.items()
                if n.startswith("wan") and m is not None and vars(m).get("flash_attention") is orig]
    # idempotent, and re-callable with another backend
    assert apply(wan, "sdpa") == patched
    assert apply(wan, "fa2") == patched
    assert wan.modules.s2v.motioner.flash_attention is pa.fa2_attention
    assert wan.distributed.ulysses.flash_attention is pa.fa2_attention
    assert apply(wan, "sdpa") == patched
    with pytest.raises(ValueError):
        apply(wan, "auto")


def test_attention_helper_routes_and_masks(wan):
    apply(wan, "sdpa")
    q, k, v = rand()
    kl = torch.tensor([9, 4])
    out = wan.modules.attention.attention(q, k, v, k_lens=kl)  # upstream ignored k_lens here
    torch.testing.assert_close(out.double(), ref_attention(q, k, v, k_lens=kl),
                               atol=1e-5, rtol=1e-5)


def _freqs(d):
    rp = sys.modules["wan.modules.model"].rope_params
    return torch.cat([rp(1024, d - 4 * (d // 6)), rp(1024, 2 * (d // 6)),
                      rp(1024, 2 * (d // 6))], dim=1)


def test_wan_self_and_cross_attention_run_on_cpu(wan):
    apply(wan, "sdpa")
    M = wan.modules.model
    torch.manual_seed(0)
    dim, heads, B, (f, h, w) = 32, 4, 2, (2, 2, 3)
    L = f * h * w
    attn = M.WanSelfAttention(dim, heads).eval()
    x = torch.randn(B, L, dim)
    seq_lens = torch.tensor([L, L - 5])
    grid = torch.tensor([[f, h, w]] * B)
    freqs = _freqs(dim // heads)
    with torch.no_grad():
        y = attn(x, seq_lens, grid, freqs)
        # same computation by hand with the float64 reference
        d = dim // heads
        qq = M.rope_apply(attn.norm_q(attn.q(x)).view(B, L, heads, d), grid, freqs)
        kk = M.rope_apply(attn.norm_k(attn.k(x)).view(B, L, heads, d), grid, freqs)
        vv = attn.v(x).view(B, L, heads, d)
        ref = attn.o(ref_attention(qq, kk, vv, k_lens=seq_lens).float().flatten(2))
    assert y.shape == (B, L, dim) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)

    cross = M.WanCrossAttention(dim, heads).eval()
    with torch.no_grad():
        z = cross(x, torch.randn(B, 5, dim), torch.tensor([5, 2]))
    assert z.shape == (B, L, dim) and not z.isnan().any()


def test_s2v_self_attention_runs_on_cpu(wan):
    apply(wan, "sdpa")
    S = wan.modules.s2v.model_s2v
    torch.manual_seed(1)
    dim, heads, (f, h, w) = 32, 4, (1, 2, 2)
    L = f * h * w
    attn = S.WanS2VSelfAttention(dim, heads).eval()
    with torch.no_grad():
        y = attn(torch.randn(1, L, dim), torch.tensor([L]), torch.tensor([[f, h, w]]),
                 _freqs(dim // heads))
    assert y.shape == (1, L, dim) and math.isfinite(float(y.abs().sum()))


def _visible(Lq, Lk, **kw):
    """Which keys each query sees: q = 0 gives a uniform softmax over the visible keys and a
    one-hot v per key turns the output row into that set."""
    q = torch.zeros(1, Lq, 1, 4, dtype=torch.float64)
    k = torch.randn(1, Lk, 1, 4, dtype=torch.float64)
    v = torch.eye(Lk, dtype=torch.float64).view(1, Lk, 1, Lk)
    return (sdpa_attention(q, k, v, **kw)[0, :, 0] > 0).int().tolist()


def test_masks_match_flash_attn_documented_examples():
    # flash_attn_varlen_func docstring: causal masks are aligned to the bottom-right corner
    assert _visible(2, 5, causal=True) == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert _visible(5, 2, causal=True) == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # window: keys in [i + sk - sq - left, i + sk - sq + right]
    assert _visible(3, 5, window_size=(1, 0)) == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0],
                                                  [0, 0, 0, 1, 1]]
    # per-item lengths move the corner: item with sq=2, sk=3 inside padded Lq=4, Lk=5
    assert _visible(4, 5, causal=True, q_lens=[2], k_lens=[3]) == [
        [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_fast_paths_mask_shapes(monkeypatch):
    seen = []
    real = pa.F.scaled_dot_product_attention

    def spy(*a, **kw):
        m = kw.get("attn_mask")
        seen.append(None if m is None else tuple(m.shape))
        return real(*a, **kw)

    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", spy)
    q, k, v = rand()  # B=2, Lq=7, Lk=9
    sdpa_attention(q, k, v)
    sdpa_attention(q, k, v, k_lens=torch.tensor([9, 9]))  # S2V self-attn: seq_lens == L
    sdpa_attention(q, k, v, q_lens=torch.tensor([7, 7]))
    sdpa_attention(q, k, v, k_lens=torch.tensor([9, 4]))
    sdpa_attention(q, k, v, k_lens=torch.tensor([9, 4]), causal=True)
    assert seen == [None, None, None, (2, 1, 1, 9), (2, 1, 7, 9)]


# ---------------------------------------------------------------- FlashAttention-4 (flash_attn.cute)
FA4_STANDIN = Path(__file__).parent / "data" / "fa4_standin"


@pytest.fixture
def fa4(monkeypatch):
    """The tests' stand-in for flash-attn-4 as ``flash_attn.cute`` under a namespace ``flash_attn``
    (as the real wheel installs it; set in sys.modules, so a flash-attn 2 installed on the machine
    does not shadow it); its call log cleared."""
    import importlib
    import types

    import wan_s2v_runner.shared.attention_backends as ab

    ns = types.ModuleType("flash_attn")
    ns.__path__ = [str(FA4_STANDIN / "flash_attn")]  # a namespace package: no __file__
    ns.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    ns.__spec__.submodule_search_locations = ns.__path__
    monkeypatch.setitem(sys.modules, "flash_attn", ns)
    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    ab._measure.cache_clear()
    mod = importlib.import_module("flash_attn.cute")
    mod.CALLS.clear()
    yield mod
    sys.modules.pop("flash_attn.cute", None)
    ab._measure.cache_clear()


@pytest.mark.parametrize("case", list(CASES))
def test_fa4_attention_keeps_upstreams_contract(case, fa4):
    """fa4_attention through the custom op: the same values as the float64 reference on the
    bf16-rounded inputs (its kernels take half precision, as upstream casts for FA), padded rows
    zero, the output in q's dtype; dense inputs use flash_attn_func, ragged ones the varlen entry
    point; FA4 is called with keyword arguments only (the stand-in refuses positional ones)."""
    spec = CASES[case]
    q, k, v = rand(**spec.get("shape", {}))
    kw = spec.get("kw", {})
    out = pa.fa4_attention(q, k, v, **kw)
    ref = ref_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    assert out.dtype == torch.float32 and out.shape == ref.shape and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    lens = {n: kw.get(n) for n in ("q_lens", "k_lens")}
    ragged = any(t is not None and bool((torch.as_tensor(t).clamp(max=L) != L).any())
                 for t, L in ((lens["q_lens"], q.shape[1]), (lens["k_lens"], k.shape[1])))
    assert [c[0] for c in fa4.CALLS] == ["flash_attn_varlen_func" if ragged else "flash_attn_func"]


def test_fa4_is_one_opaque_op_under_compile(fa4):
    """A compiled caller sees FA4 as one custom op (wan_s2v::fa4): in the graph, none of the
    kernel's own work traced into it, no graph break, the same values."""
    from torch._dynamo.utils import counters

    q, k, v = rand(Lq=9, Lk=9)
    counters.clear()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(q, k, v):
        return pa.fa4_attention(q * 1.0, k, v).sum(-1)

    got = torch.compile(f, fullgraph=True, dynamic=False, backend=record)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v))
    assert int(sum(counters["graph_break"].values())) == 0 and len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.wan_s2v.fa4.default in targets or torch.ops.wan_s2v.fa4 in targets, targets
    assert not any("einsum" in str(t) or "logsumexp" in str(t) for t in targets)  # the stand-in's own work


def test_fa4_refuses_dropout(fa4):
    q, k, v = rand()
    with pytest.raises(ValueError, match="FA4 has no dropout"):
        pa.fa4_attention(q, k, v, dropout_p=0.1)


def test_fa4_measured_like_the_others(fa4):
    """Installed but no GPU: measured as present and not usable, with the reason; the namespace
    ``flash_attn`` it leaves is not taken for FlashAttention-2."""
    got = measure_availability("cuda")
    assert got["fa4"]["installed"] and got["fa4"]["usable"] is False
    assert got["fa4"]["reason"] in ("torch.cuda.is_available() is False", "flash-attn kernels are CUDA-only (no GPU)")
    assert got["fa2"]["installed"] is None and "only a namespace" in got["fa2"]["reason"]
    assert measure_availability("cpu", ("fa4",))["fa4"]["reason"] == "flash-attn kernels are CUDA-only (no GPU)"


def test_fa4_rule():
    """Explicit fa4 runs on SM90/SM100 only; auto takes it only where it measured faster than SDPA
    (FA4_FASTER_ON), after FA3."""
    from wan_s2v_runner.shared.attention_backends import FA4_FASTER_ON, auto_candidates

    usable = {b: {"installed": "x", "usable": True, "reason": f"{b} runs"} for b in ("fa4",)}
    assert choose_backend("fa4", "cuda", usable, (9, 0)) == ("fa4", "fa4 runs")
    assert choose_backend("fa4", "cuda", usable, (10, 0)) == ("fa4", "fa4 runs")
    with pytest.raises(BackendUnavailable, match=r"needs compute capability 9.0 or 10.0 or 10.3 .*the GPU has 8.9"):
        choose_backend("fa4", "cuda", usable, (8, 9))
    with pytest.raises(BackendUnavailable, match=r"needs a CUDA device"):
        choose_backend("fa4", "cpu", usable, None)
    with pytest.raises(BackendUnavailable, match=r"flash-attn 4 .* not usable: availability not measured.*"
                                                 r"pip install flash-attn-4"):
        choose_backend("fa4", "cuda", {}, (9, 0))
    for cc in FA4_FASTER_ON:  # where it measured faster: auto takes it (FA3 first, where usable)
        assert choose_backend("auto", "cuda", usable, cc)[0] == "fa4"
    slower = [cc for cc in ((9, 0), (10, 0)) if cc not in FA4_FASTER_ON]
    for cc in slower:  # not measured faster: auto keeps SDPA even with FA4 usable
        assert "fa4" not in auto_candidates(cc)
        assert choose_backend("auto", "cuda", usable, cc)[0] == "sdpa"
    both = {**usable, "fa3": {"installed": "x", "usable": True, "reason": "fa3 runs"}}
    assert choose_backend("auto", "cuda", both, (9, 0), fa4_faster_on=((9, 0),)) == ("fa3", "fa3 runs")
    assert choose_backend("auto", "cuda", usable, (9, 0), fa4_faster_on=((9, 0),)) == ("fa4", "fa4 runs")
    assert choose_backend("auto", "cuda", usable, (10, 0), fa4_faster_on=((9, 0),))[0] == "sdpa"


def test_a_broken_flash_attn_2_blocks_fa4_and_says_so(fa4, monkeypatch):
    """flash-attn 2 and 4 share one ``flash_attn`` package: when the guard parked a broken FA2,
    FA4 is reported blocked by it (with the cause), not "not installed"."""
    import wan_s2v_runner.shared.attention_backends as ab

    monkeypatch.setattr(ab, "_IMPORT_FAILURES", {"flash_attn": (
        "ImportError: x.so: undefined symbol: _Zfoo", "ABI mismatch: its CUDA extension was built for another "
        "torch (undefined symbol _Zfoo)")})
    ab._measure.cache_clear()
    got = measure_availability("cuda", ("fa4",))["fa4"]
    assert got["usable"] is False and got["reason"].startswith("blocked by the broken flash-attn 2")
    assert "_Zfoo" in got["reason"] and got["import_error"].startswith("ImportError")
