"""A stand-in for flash-attn-4's ``flash_attn.cute`` on the CPU (the tests' own, not FA4): its two
entry points with FA4's interface as the runner calls it (keyword arguments only; dense
[B, L, N, C] or packed varlen [total, N, C] with ``cu_seqlens_*``; ``window_size`` sides None for
unbounded; returns ``(out, lse)``), computed plainly in float32. Like the real wheel it installs
``flash_attn/cute/`` under a namespace ``flash_attn`` (no ``flash_attn/__init__.py``). ``CALLS``
records which entry point ran with which keywords."""
import torch

__version__ = "4.0.0b36-standin"
CALLS = []


def _one(q, k, v, softmax_scale, causal, window_size):
    """q [Lq, N, C], k/v [Lk, Nk, C]: bottom-right aligned masks as flash-attn defines them."""
    lq, n, c = q.shape
    lk, nk = k.shape[0], k.shape[1]
    scale = c ** -0.5 if softmax_scale is None else softmax_scale
    kk = k.float().repeat_interleave(n // nk, 1)
    vv = v.float().repeat_interleave(n // nk, 1)
    s = torch.einsum("qnc,knc->nqk", q.float(), kk) * scale
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    d = i + lk - lq
    ok = torch.ones(lq, lk, dtype=torch.bool)
    left, right = window_size
    if causal:
        ok &= j <= d
    if left is not None:
        ok &= j >= d - left
    if right is not None:
        ok &= j <= d + right
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    return torch.einsum("nqk,knc->qnc", p, vv).to(q.dtype), lse


def flash_attn_func(*args, q=None, k=None, v=None, softmax_scale=None, causal=False,
                    window_size=(None, None), **rest):
    if args:
        raise TypeError("the stand-in takes keyword arguments only, as the runner calls FA4")
    CALLS.append(("flash_attn_func", sorted(["q", "k", "v", "softmax_scale", "causal", "window_size", *rest])))
    outs = [_one(q[b], k[b], v[b], softmax_scale, causal, window_size) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs])


def flash_attn_varlen_func(*args, q=None, k=None, v=None, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=False,
                           window_size=(None, None), **rest):
    if args:
        raise TypeError("the stand-in takes keyword arguments only, as the runner calls FA4")
    CALLS.append(("flash_attn_varlen_func", sorted(["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                    "max_seqlen_k", "softmax_scale", "causal", "window_size", *rest])))
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    lses = []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:
            continue  # no key: zeros, as flash-attn writes
        o, lse = _one(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, causal, window_size)
        out[q0:q1] = o
        lses.append(lse)
    return out, lses
