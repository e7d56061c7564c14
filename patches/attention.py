"""Patch: choose the attention kernel (FA4 / FA3 / FA2 / PyTorch SDPA) and route every Wan caller to it.

Upstream (``wan/modules/attention.py``, byte-identical in wan22==2.2.11 and Wan2.2 HEAD):
  * ``flash_attention(q, k, v, q_lens, k_lens, ...)`` asserts ``q.device.type == 'cuda'``, then uses
    FlashAttention-3 (``flash_attn_interface``) if it imported, else *asserts* FlashAttention-2.
    There is no SDPA fallback on the S2V path, so CPUs, pre-Ampere GPUs and machines without a
    working flash-attn cannot run S2V at all.
  * The FA3 branch does ``flash_attn_varlen_func(...)[0]``: FA3 builds that return a bare Tensor
    (newer hopper builds, unless return_attn_probs) make ``[0]`` take the first *token*, and the
    following ``unflatten(0, (b, lq))`` then fails.
  * ``q_lens``: upstream packs the first q_lens[b] queries of each item but unflattens the packed
    output with ``(b, lq)``: it raises unless sum(q_lens) == B*Lq, and when ragged lengths happen
    to sum to B*Lq it silently assigns rows to the wrong items. No Wan caller passes q_lens, but
    our backends define it properly (padded rows are zero). ``k_lens`` > Lk is clamped by the
    slicing but not in cu_seqlens upstream; we clamp both.
  * Availability is probed at import with ``except ModuleNotFoundError`` only. A flash-attn wheel
    built for another torch fails with ``ImportError: ... undefined symbol: ...`` (ABI mismatch),
    which is *not* a ModuleNotFoundError, so ``import wan`` itself crashes.
    ``guard_flash_attn_imports()`` must run before ``import wan`` to turn that into "not
    available" (it parks ``None`` in ``sys.modules`` for the broken module).
  * Callers bind the function *by name* (``from .attention import flash_attention``): model.py,
    s2v/model_s2v.py, s2v/motioner.py (via ``..model``), distributed/ulysses.py (Ulysses path),
    modules/__init__.py, animate/clip.py, animate/model_animate.py. Rebinding only
    ``wan.modules.attention.flash_attention`` changes none of them.
  * The unused-by-S2V helper ``attention()`` falls back to SDPA when no flash-attn is installed,
    but that fallback *ignores* q_lens/k_lens (only warns) and returns bf16. We rebind it too (see
    ``apply``), so anything calling it gets the same, correctly masked backend.

Change:
  * ``resolve_backend(requested, device_type)`` picks fa3 > fa4 (only where it measured faster)
    > fa2 > sdpa for ``auto`` on CUDA after a real import *and* a tiny kernel call (catches ABI
    mismatch, wrong GPU arch), always sdpa on CPU; an explicit fa4/fa3/fa2 that cannot work raises
    a one-line RuntimeError with the fix. The
    measurement and the rule live in ``wan_s2v_runner.shared.attention_backends``
    (``measure_availability`` + ``choose_backend``), which the doctor applies to recorded facts,
    so its prediction and the run's choice cannot drift apart; ``guard_flash_attn_imports`` is
    there too and re-exported here.
  * ``sdpa_attention`` reproduces flash-attn varlen semantics with
    ``torch.nn.functional.scaled_dot_product_attention`` (see its docstring); ``fa3_attention``
    fixes the tuple/Tensor return; ``fa2_attention`` is upstream's own code with ``version=2``;
    ``fa4_attention`` (not in upstream) calls FlashAttention-4's CuTe-DSL kernels
    (``flash_attn.cute``: ``flash_attn_func``, or ``flash_attn_varlen_func`` for ragged lengths,
    keyword arguments only) through the custom op ``wan_s2v::fa4``, so a compiler sees one opaque
    call and never traces into the DSL (``--compile`` keeps one graph per block).
  * ``apply(wan, backend)`` rebinds ``flash_attention`` (and ``attention``) in every imported
    ``wan.*`` module that still holds upstream's function (or one of ours), and checks the S2V
    modules are among them.

Proof (tests/test_attention.py, CPU): ``sdpa_attention`` matches a naive float64 per-item,
per-head reference (ragged k_lens/q_lens, causal with Lq != Lk, windows, GQA, scales, fully
masked rows) in fp32 and fp64; after ``apply`` the S2V modules hold ``sdpa_attention`` and
``wan.modules.model.WanSelfAttention`` runs on CPU, where upstream's function asserts.
``fa4_attention``'s packing, window and return handling run on CPU against a stand-in with FA4's
interface (``tests/data/fa4_standin``); the kernels themselves only on a GPU (docs/gpu.md).
"""
from __future__ import annotations

import importlib
import logging
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from patches.patch import Patch, always
from wan_s2v_runner.shared.attention_backends import (  # noqa: F401  (loading/engine.py calls the guard from here)
    BACKENDS,
    REQUESTS,
    BackendUnavailable,
    auto_candidates,
    choose_backend,
    cuda_capability,
    guard_flash_attn_imports,
    measure_availability,
    runs_here,
)

log = logging.getLogger(__name__)

# Modules of the S2V path that bind ``flash_attention`` by name; apply() must reach all of them.
S2V_MODULES = (
    "wan.modules.attention",
    "wan.modules.model",
    "wan.modules.s2v.model_s2v",
    "wan.modules.s2v.motioner",
    "wan.distributed.ulysses",
)

_MARK = "_wan_s2v_backend"  # attribute set on our replacement functions
_ORIG_FA_ATTR = "_wan_s2v_original_flash_attention"  # stored on wan.modules.attention
_ORIG_ATTN_ATTR = "_wan_s2v_original_attention"


# --------------------------------------------------------------------------- backend choice
def resolve_backend(requested: str = "auto", device_type: str = "cuda") -> tuple[str, str]:
    """Return (backend, reason) for this process: ``choose_backend`` on a live measurement.

    auto: CUDA -> fa3 if usable, else fa4 where it measured faster (``FA4_FASTER_ON``), else fa2
    if usable, else sdpa; any other device -> sdpa. fa4/fa3/fa2 explicitly: BackendUnavailable (a
    RuntimeError: cause + fix) if not usable. sdpa: always allowed, and flash-attn is then not
    even imported; the backends the request can pick are measured in order until one runs
    (FA4's measurement compiles its kernel: not paid where FA3 wins)."""
    req = (requested or "auto").lower()
    flash = device_type == "cuda" and req != "sdpa"
    cc = cuda_capability() if flash else None
    avail: dict = {}
    if flash and req in REQUESTS:
        for cand in (auto_candidates(cc) if req == "auto" else (req,)):  # in order; the first that runs wins
            avail.update(measure_availability(device_type, (cand,)))
            if runs_here(cand, avail[cand], cc)[0]:
                break
    return choose_backend(requested, device_type, avail, cc, torch_version=torch.__version__,
                          cuda_version=torch.version.cuda)


# --------------------------------------------------------------------------- SDPA backend
def _lens(lens, default: int, b: int, device) -> Optional[torch.Tensor]:
    """Per-item lengths as an int64 tensor clamped to [0, default], or None if all == default."""
    if lens is None:
        return None
    t = torch.as_tensor(lens, device=device).to(torch.int64).reshape(b).clamp(0, default)
    if bool((t == default).all()):  # one host sync, like upstream's per-item slicing
        return None
    return t


def sdpa_attention(
    q,
    k,
    v,
    q_lens=None,
    k_lens=None,
    dropout_p=0.,
    softmax_scale=None,
    q_scale=None,
    causal=False,
    window_size=(-1, -1),
    deterministic=False,
    dtype=torch.bfloat16,
    version=None,
):
    """Drop-in for upstream ``flash_attention`` using torch SDPA; works on any device.

    q [B, Lq, Nq, C1], k [B, Lk, Nk, C1], v [B, Lk, Nk, C2], Nq % Nk == 0 (GQA: query head h uses
    kv head h // (Nq // Nk)). Returns [B, Lq, Nq, C2] in q's dtype. Same meaning as flash-attn
    varlen on the packed sequences: item b attends with its first q_lens[b] queries to its first
    k_lens[b] keys (lengths clamped to Lq/Lk); output rows >= q_lens[b] are zero; causal/window
    masks are aligned bottom-right per item (query i sees key j iff j <= i + sk - sq for causal,
    and i + sk - sq - left <= j <= i + sk - sq + right for a window, -1 = unbounded); a query
    with no visible key gives zeros, not NaN. softmax_scale defaults to C1 ** -0.5; q_scale
    multiplies q first.

    Precision: computed in the inputs' (promoted) dtype. Upstream casts fp32 to ``dtype`` (bf16)
    only because FA kernels accept half types; SDPA needs no cast, so fp32 stays fp32. ``dtype``,
    ``deterministic`` and ``version`` are accepted for signature compatibility and unused.

    Fast paths: no masking needed -> SDPA without a mask (flash/efficient kernels stay eligible);
    only k_lens -> a broadcast [B, 1, 1, Lk] key mask; otherwise a [B, 1, Lq, Lk] mask.
    """
    b, lq, nq, c1 = q.shape
    lk, nk = k.shape[1], k.shape[2]
    if nq % nk:
        raise ValueError(f"number of query heads {nq} must be divisible by kv heads {nk}")
    out_dtype = q.dtype
    cdtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    if q_scale is not None:
        q = q * q_scale

    q_l = _lens(q_lens, lq, b, q.device)
    k_l = _lens(k_lens, lk, b, q.device)
    left, right = (int(w) for w in window_size)
    positional = causal or left >= 0 or right >= 0

    mask = None  # bool, True = may attend
    row_ok = None  # bool [B, 1, Lq, 1], False -> output row forced to zero
    if q_l is None and not positional:
        if k_l is not None:
            mask = (torch.arange(lk, device=q.device) < k_l[:, None]).view(b, 1, 1, lk)
            row_ok = (k_l > 0).view(b, 1, 1, 1)  # k_lens[b] == 0: no key at all
    else:
        sq = torch.full((b,), lq, device=q.device, dtype=torch.int64) if q_l is None else q_l
        sk = torch.full((b,), lk, device=q.device, dtype=torch.int64) if k_l is None else k_l
        i = torch.arange(lq, device=q.device).view(1, lq, 1)
        j = torch.arange(lk, device=q.device).view(1, 1, lk)
        diag = i + (sk - sq).view(b, 1, 1)  # bottom-right aligned diagonal, per item
        mask = (i < sq.view(b, 1, 1)) & (j < sk.view(b, 1, 1))
        if causal:
            mask = mask & (j <= diag)
        if left >= 0:
            mask = mask & (j >= diag - left)
        if right >= 0:
            mask = mask & (j <= diag + right)
        mask = mask.unsqueeze(1)  # [B, 1, Lq, Lk]
        row_ok = mask.any(-1, keepdim=True)
    if row_ok is not None:
        if bool(row_ok.all()):
            row_ok = None
        else:  # let empty rows attend everywhere (no NaN in any kernel), zero them afterwards
            mask = mask | ~row_ok

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    kw = dict(attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale)
    if nq != nk:
        try:
            out = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, **kw)
        except TypeError:  # torch < 2.5
            g = nq // nk
            out = F.scaled_dot_product_attention(
                qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1), **kw)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, **kw)
    if row_ok is not None:
        out = out.masked_fill(~row_ok, 0)
    return out.transpose(1, 2).contiguous().to(out_dtype)


# --------------------------------------------------------------------------- flash-attn backends
def _original_flash_attention() -> Callable:
    mod = sys.modules.get("wan.modules.attention")
    if mod is None:
        raise RuntimeError("wan.modules.attention is not imported; import wan first")
    fn = getattr(mod, _ORIG_FA_ATTR, None) or mod.flash_attention
    if getattr(fn, _MARK, None):
        raise RuntimeError("cannot find upstream flash_attention (already replaced)")
    return fn


def fa2_attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0., softmax_scale=None,
                  q_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                  dtype=torch.bfloat16, version=None):
    """FlashAttention-2: upstream's own function with version=2 (skips its FA3 branch)."""
    return _original_flash_attention()(
        q, k, v, q_lens=q_lens, k_lens=k_lens, dropout_p=dropout_p, softmax_scale=softmax_scale,
        q_scale=q_scale, causal=causal, window_size=window_size, deterministic=deterministic,
        dtype=dtype, version=2)


def _pack(x, lens):
    """[B, L, ...] -> ([sum(lens), ...], int32 lens) like upstream (full length if lens None)."""
    b, length = x.shape[:2]
    if lens is None:
        return x.flatten(0, 1), torch.full((b,), length, dtype=torch.int32, device=x.device)
    lens = torch.as_tensor(lens, device=x.device).to(torch.int32).clamp(0, length)
    keep = torch.arange(length, device=x.device)[None, :] < lens[:, None]
    return x[keep], lens


def _half_inputs(q, k, v, dtype, q_scale, q_lens=None, k_lens=None, pack: bool = True):
    """q, k, v as the flash-attn kernels take them: half precision (fp32 cast to ``dtype``, as
    upstream casts), q and k in v's dtype, q scaled; with ``pack``, packed like upstream
    (:func:`_pack`). Returns (q, k, v, q lens, k lens); the lens are None without ``pack``."""
    half_dtypes = (torch.float16, torch.bfloat16)

    def half(x):
        return x if x.dtype in half_dtypes else x.to(dtype)

    ql = kl = None
    if pack:
        q, ql = _pack(q, q_lens)
        k, kl = _pack(k, k_lens)
        v, _ = _pack(v, k_lens)
    q, k, v = half(q), half(k), half(v)
    q, k = q.to(v.dtype), k.to(v.dtype)
    if q_scale is not None:
        q = q * q_scale
    return q, k, v, ql, kl


def _cu_seqlens(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([lens.new_zeros([1]), lens]).cumsum(0, dtype=torch.int32)


def _unpack(x, b: int, lq: int, ql, q_lens):
    """Packed output rows -> [B, Lq, ...]: ``unflatten`` when every query was kept, else scattered
    back with zeros in the padding (upstream's ``unflatten`` is wrong unless all q_lens == Lq)."""
    if q_lens is None:
        return x.unflatten(0, (b, lq))
    full = x.new_zeros((b, lq) + tuple(x.shape[1:]))
    full[torch.arange(lq, device=x.device)[None, :] < ql[:, None]] = x
    return full


def fa3_attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0., softmax_scale=None,
                  q_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                  dtype=torch.bfloat16, version=None):
    """FlashAttention-3 (Hopper). Upstream's FA3 branch with three fixes: accepts a Tensor or a
    tuple return; scatters q_lens-packed output back to [B, Lq] (zeros in the padding) instead
    of ``unflatten`` (wrong unless all q_lens == Lq); forwards a non-default window_size
    (upstream silently dropped it). FA3 has no dropout: dropout_p > 0 raises."""
    import flash_attn_interface  # optional GPU dependency, imported lazily

    assert dtype in (torch.float16, torch.bfloat16)
    assert q.device.type == "cuda" and q.size(-1) <= 256
    if dropout_p:
        raise ValueError("FA3 has no dropout; use --attention fa2 or sdpa")
    b, lq, lk, out_dtype = q.size(0), q.size(1), k.size(1), q.dtype
    qp, kp, vp, ql, kl = _half_inputs(q, k, v, dtype, q_scale, q_lens, k_lens)
    extra = {}
    if tuple(window_size) != (-1, -1):
        extra["window_size"] = tuple(window_size)
    x = flash_attn_interface.flash_attn_varlen_func(
        q=qp, k=kp, v=vp, cu_seqlens_q=_cu_seqlens(ql), cu_seqlens_k=_cu_seqlens(kl),
        max_seqlen_q=lq, max_seqlen_k=lk, softmax_scale=softmax_scale, causal=causal,
        deterministic=deterministic, **extra)
    if isinstance(x, (tuple, list)):  # older FA3: (out, softmax_lse); newer: out
        x = x[0]
    return _unpack(x, b, lq, ql, q_lens).type(out_dtype)


def _fa4_module():
    import flash_attn.cute as fa4  # optional GPU dependency (flash-attn-4), imported lazily

    return fa4


@torch.library.custom_op("wan_s2v::fa4", mutates_args=())
def fa4_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
           cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
           softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int) -> torch.Tensor:
    """One FlashAttention-4 forward. Dense ([B, L, N, C]) without ``cu_seqlens_q``, else packed
    ([total, N, C], varlen). A window side < 0 is unbounded (FA4 spells it None). Returns the
    output alone (FA4 returns ``(out, lse)``)."""
    fa4 = _fa4_module()
    kw = dict(q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal,
              window_size=(window_left if window_left >= 0 else None, window_right if window_right >= 0 else None))
    if cu_seqlens_q is None:
        out = fa4.flash_attn_func(**kw)
    else:
        out = fa4.flash_attn_varlen_func(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **kw)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.contiguous()


@fa4_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
      window_right):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def fa4_attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0., softmax_scale=None,
                  q_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                  dtype=torch.bfloat16, version=None):
    """FlashAttention-4 (``flash_attn.cute``; SM90/SM100). Upstream's contract, as ``fa3_attention``
    keeps it: q/k/v in half precision (fp32 inputs cast to ``dtype``, as upstream casts for its
    kernels), the output in q's dtype; ``q_lens``/``k_lens`` ragged -> packed varlen, padded output
    rows zero; none (or all full) -> the dense kernel, no packing copy. FA4 has no dropout:
    dropout_p > 0 raises. ``deterministic`` concerns the backward only (inference: unused)."""
    assert dtype in (torch.float16, torch.bfloat16)
    if dropout_p:
        raise ValueError("FA4 has no dropout; use --attention fa2 or sdpa")
    b, lq, lk, out_dtype = q.size(0), q.size(1), k.size(1), q.dtype
    left, right = (int(w) for w in window_size)
    ragged = _lens(q_lens, lq, b, q.device) is not None or _lens(k_lens, lk, b, q.device) is not None
    qh, kh, vh, ql, kl = _half_inputs(q, k, v, dtype, q_scale, q_lens, k_lens, pack=ragged)
    if not ragged:
        return fa4_op(qh, kh, vh, None, None, lq, lk, softmax_scale, causal, left, right).type(out_dtype)
    x = fa4_op(qh, kh, vh, _cu_seqlens(ql), _cu_seqlens(kl), lq, lk, softmax_scale, causal, left, right)
    return _unpack(x, b, lq, ql, q_lens).type(out_dtype)


for _name, _fn in (("sdpa", sdpa_attention), ("fa2", fa2_attention), ("fa3", fa3_attention),
                   ("fa4", fa4_attention)):
    setattr(_fn, _MARK, _name)
IMPLEMENTATIONS = {"fa4": fa4_attention, "fa3": fa3_attention, "fa2": fa2_attention, "sdpa": sdpa_attention}


def _make_attention(impl: Callable, backend: str) -> Callable:
    """Replacement for upstream ``attention()`` (same signature, fa_version -> version)."""

    def attention(q, k, v, q_lens=None, k_lens=None, dropout_p=0., softmax_scale=None,
                  q_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                  dtype=torch.bfloat16, fa_version=None):
        return impl(q, k, v, q_lens=q_lens, k_lens=k_lens, dropout_p=dropout_p,
                    softmax_scale=softmax_scale, q_scale=q_scale, causal=causal,
                    window_size=window_size, deterministic=deterministic, dtype=dtype,
                    version=fa_version)

    setattr(attention, _MARK, backend)
    return attention


# --------------------------------------------------------------------------- rebinding
def _wan_modules(prefix: str):
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == prefix or name.startswith(prefix + ".")):
            yield name, mod


def _rebind(prefix: str, attn_mod, fa_new: Callable, attn_new: Callable) -> list[str]:
    orig_fa = getattr(attn_mod, _ORIG_FA_ATTR)
    orig_attn = getattr(attn_mod, _ORIG_ATTN_ATTR)
    patched = []
    for name, mod in _wan_modules(prefix):
        g = vars(mod)
        hit = False
        cur = g.get("flash_attention")
        if cur is not None and (cur is orig_fa or getattr(cur, _MARK, None)):
            g["flash_attention"] = fa_new
            hit = True
        cur = g.get("attention")
        if cur is not None and (cur is orig_attn or getattr(cur, _MARK, None)):
            g["attention"] = attn_new
            hit = True
        if hit:
            patched.append(name)
    return sorted(patched)


def _attention_module(wan_module):
    prefix = wan_module.__name__
    attn_mod = sys.modules.get(f"{prefix}.modules.attention") or importlib.import_module(
        f"{prefix}.modules.attention")
    # remember upstream's functions once, on the engine module itself (survives re-imports of us)
    if not hasattr(attn_mod, _ORIG_FA_ATTR):
        setattr(attn_mod, _ORIG_FA_ATTR, attn_mod.flash_attention)
        setattr(attn_mod, _ORIG_ATTN_ATTR, attn_mod.attention)
    return prefix, attn_mod


def apply(wan_module, backend: str) -> list[str]:
    """Route all Wan attention calls to ``backend`` (one of BACKENDS, e.g. from resolve_backend).

    Call after ``import wan`` (wan/__init__ imports every submodule). Rebinds ``flash_attention``
    in each loaded ``wan.*`` module whose global still is upstream's function or one of ours, and
    ``attention`` in wan.modules.attention (its own SDPA fallback ignores padding masks and its
    flash branch would only reach our function via the module global when flash-attn imported).
    Idempotent, re-callable with another backend. Returns the names of the routed modules;
    raises RuntimeError if any S2V module is missing from them."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    prefix, attn_mod = _attention_module(wan_module)
    impl = IMPLEMENTATIONS[backend]
    patched = _rebind(prefix, attn_mod, impl, _make_attention(impl, backend))
    required = [m.replace("wan.", prefix + ".", 1) for m in S2V_MODULES]
    missing = [m for m in required if m not in patched]
    if missing:
        raise RuntimeError(f"attention patch did not reach {missing}: the engine layout differs "
                           "from Wan2.2 (flash_attention no longer imported by name there?)")
    log.info("attention backend: %s (routed in %d modules: %s)", backend, len(patched),
             ", ".join(patched))
    return patched


def restore(wan_module) -> list[str]:
    """Undo apply(): put upstream's functions back. Returns the module names touched."""
    prefix, attn_mod = _attention_module(wan_module)
    return _rebind(prefix, attn_mod, getattr(attn_mod, _ORIG_FA_ATTR),
                   getattr(attn_mod, _ORIG_ATTN_ATTR))


def _for_run(wan_module, ctx) -> str:
    backend, reason = resolve_backend(ctx.spec.attention, "cpu" if ctx.on_cpu else "cuda")
    mods = apply(wan_module, backend)
    logging.getLogger("wan_s2v.patches").info("attention backend: %s (%s)", backend, reason)
    return f"{backend} ({reason}); {len(mods)} modules"


PATCH = Patch("attention", applies=always, apply=_for_run, restore=restore)
