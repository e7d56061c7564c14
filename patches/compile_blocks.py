"""Patch: ``--compile``: each DiT block runs as one compiled graph, and one compiled block serves all.

Upstream (``wan/modules/s2v/model_s2v.py``): ``WanModel_S2V.forward`` calls its 40
``WanS2VAttentionBlock`` s one by one, eagerly. Peers that run Wan fast compile this repeated
block (diffusers' ``compile_repeated_blocks``, vLLM-Omni, LightX2V, VideoX-Fun, ComfyUI-WanVideo).
``torch.compile`` on upstream's block breaks the graph in every call (``bench/gpu_step.py
--compile`` on an H200: 9 graphs, 6 breaks): ``e[1].item()`` (the segment index); RoPE in
``complex128`` in a Python loop per sample (``view_as_complex``); the attention call (the
flash-attn wrapper's asserts and host syncs, Ulysses' all-to-all); the cross-attention's k/v memo
(``patches.context_cache``, a Python lookup by object).

Change (only with ``--compile``; without it nothing here is applied and eager runs as before, to
the bit): ``WanS2VAttentionBlock.forward`` becomes a short eager prelude plus one compiled body
(``torch.compile(fullgraph=True, dynamic=False)``: a graph break is an error, not a slowdown):

* the prelude, eager, does what cannot be traced and costs nothing: reads the segment index once
  (``int(e[1])``, the same host sync as upstream's ``.item()``) and passes it as a Python int;
  takes the text keys and values from the context memo (or projects them, as upstream does);
  views the complex RoPE table as real (``view_as_real``, no copy);
* the body is upstream's block, line for line (modulation, the two token segments, the
  ``float32`` autocast regions, self-attention, cross-attention, FFN), with two equivalent forms:
  RoPE as real arithmetic in ``float64`` (``(a + ib)(c + id) = (ac - bd) + i(ad + bc)``, what the
  complex multiply computes), and every attention call (self, Ulysses, cross) through one custom
  op, ``wan_s2v::attention``, which runs the attention function the engine resolves at that
  moment (``patches.attention``'s backend, ``patches.ulysses_sp``'s exchange): opaque to the
  compiler, so SDPA, flash-attn and gloo/NCCL collectives all work inside a compiled block.

Shapes are static: a (size, frames, segment) compiles once per process and is reused by every
block, every step, every clip and every later job of a served group (under CUDA's bf16 autocast
twice: block 0 gets the patch embedding's bf16 hidden states, blocks 1-39 the float32 the gated
add returns; an H200 at real size: 11 s + 3 s, then 0.85x eager's step); a new one compiles once
and is reported (``on_compile``). Inductor's cache lives under the user's cache directory
(:func:`wan_s2v_runner.shared.inductor.cache_dir`, shared by a node's ranks): a second run or a
restarted server loads the compiled kernels instead of building them.

A warm start is warm in AOTAutograd too: torch 2.13 keeps no AOTAutograd cache entry for a graph
that calls a function outside its allow-list, and the autocast regions' enter and exit are outside
it (each rank then traced the block's forward through AOTAutograd again at every start; the
inductor kernels were cached). The region's device, dtype and switches are constants in the graph's
code, which the cache key holds, so equal keys mean equal graphs: :func:`apply` marks the two
functions cacheable (``torch._inductor.config.unsafe_marked_cacheable_functions``, keyed by torch's
version; torch 2.13 keeps config overrides per thread, so the mark holds on the thread that applied
it, the rank's main thread, where the blocks compile) and :func:`restore` unmarks them. Each new
specialization's ``compile`` event says what the caches answered (``cache``:
``autograd_cache_hit``, ``fxgraph_cache_miss``...); a warm tiny compiled start on the CPU: 2.2 s a
rank against 2.9.

Bounds (fp32, CPU): the compiled block differs from eager by float rounding only (inductor fuses
the norms and elementwise work); measured by ``tests/test_compile.py``, which asserts them.
Proof: ``tests/test_compile.py`` (no graph break: ``fullgraph``; one compilation for all blocks;
compiled vs eager within the bound; eager unchanged by applying and restoring; compiled layouts
over real gloo ranks against the compiled one-process run).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from typing import Callable, Optional

import torch

from patches import context_cache
from wan_s2v_runner.shared.inductor import CACHE_ENV, cache_dir

log = logging.getLogger("wan_s2v.patches.compile_blocks")

_UPSTREAM = "_wan_s2v_upstream_forward"
#: compiled specializations kept per process (sizes x first/later clip x ranks' segments); torch's
#: default of 8 would fall back to eager after a few sizes in a long-lived server
CACHE_SIZE_LIMIT = 64

#: the autocast region's graph nodes, marked cacheable for AOTAutograd (see the module docstring)
AUTOCAST_NODES = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")

#: which attention the custom op runs
SELF, SELF_SP, CROSS = 0, 1, 2


# --------------------------------------------------------------------------- the attention op
def _attention_fn(which: int) -> Callable:
    if which == CROSS:
        return importlib.import_module("wan.modules.model").flash_attention
    model_s2v = importlib.import_module("wan.modules.s2v.model_s2v")
    return model_s2v.distributed_attention if which == SELF_SP else model_s2v.flash_attention


@torch.library.custom_op("wan_s2v::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_lens: Optional[torch.Tensor],
                 which: int, amp: Optional[torch.dtype]) -> torch.Tensor:
    """The engine's attention as it resolves now: ``which`` = SELF (``flash_attention`` of the S2V
    block, ``k_lens`` = seq_lens), SELF_SP (Ulysses' ``distributed_attention``) or CROSS.

    ``amp``: the autocast dtype the caller ran under (None: autocast off). A compiled graph calls
    its custom ops with autocast off (the graph's own casts are baked in), but upstream's attention
    runs under the loop's autocast: SDPA there gets bf16 inputs. Without re-entering it, SDPA ran
    in fp32 on the rope's fp32 q/k (an H200 step took over 4x eager's time)."""
    fn = _attention_fn(which)
    with torch.autocast(q.device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
        if which == SELF_SP:
            out = fn(q, k, v, k_lens)
        else:
            out = fn(q=q, k=k, v=v, k_lens=k_lens)
    return out.contiguous()


@attention_op.register_fake
def _(q, k, v, k_lens, which, amp):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# --------------------------------------------------------------------------- the block, compiled
def _cuda_autocast(**kw):
    # upstream's ``torch.cuda.amp.autocast(...)``, in the form torch does not deprecate
    return torch.autocast("cuda", **kw)


def rope_real(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Upstream's ``rope_apply`` / ``rope_apply_usp`` with ``freqs`` as ``view_as_real`` of its
    complex table ([B, >=S, 1, C/2, 2], float64): x [B, S, N, C] -> float32."""
    b, s, n, _ = x.shape
    with _cuda_autocast(enabled=False):
        xr = x.to(torch.float64).reshape(b, s, n, -1, 2)
        a, bi = xr[..., 0], xr[..., 1]
        f = freqs[:, :s]
        c, d = f[..., 0], f[..., 1]
        out = torch.stack((a * c - bi * d, a * d + bi * c), dim=-1).flatten(3)
        return out.float()


def _modulate(t, seg_idx, shift, scale):
    """Each token segment of ``t`` (float) scaled and shifted by its own modulation column."""
    return torch.cat([t[:, seg_idx[i]:seg_idx[i + 1]] * (1 + scale[:, i:i + 1]) + shift[:, i:i + 1]
                      for i in range(2)], dim=1)


def _gated_add(x, y, seg_idx, gate):
    """``x + y`` with each token segment of ``y`` gated by its own column, in float32 (autocast)."""
    with _cuda_autocast(dtype=torch.float32):
        return x + torch.cat([y[:, seg_idx[i]:seg_idx[i + 1]] * gate[:, i:i + 1] for i in range(2)], dim=1)


def _body(block, x, e0, seg: int, seq_lens, freqs, context_k, context_v, context_lens, sp: bool,
          sp_dtype: torch.dtype, amp: Optional[torch.dtype]):
    """``WanS2VAttentionBlock.forward`` with the prelude's values (see the module docstring)."""
    seg_idx = [0, seg, x.size(1)]
    modulation = block.modulation.unsqueeze(2)
    with _cuda_autocast(dtype=torch.float32):
        e = (modulation + e0).chunk(6, dim=1)
    e = [element.squeeze(1) for element in e]
    norm_x = _modulate(block.norm1(x).float(), seg_idx, e[0], e[1])

    # self-attention (WanS2VSelfAttention.forward, or sp_attn_forward_s2v under Ulysses)
    sa = block.self_attn
    b, s, n, d = *norm_x.shape[:2], sa.num_heads, sa.head_dim
    q = sa.norm_q(sa.q(norm_x)).view(b, s, n, d)
    k = sa.norm_k(sa.k(norm_x)).view(b, s, n, d)
    v = sa.v(norm_x).view(b, s, n, d)
    q, k = rope_real(q, freqs), rope_real(k, freqs)
    if sp:
        def half(t):
            return t if t.dtype in (torch.float16, torch.bfloat16) else t.to(sp_dtype)
        y = attention_op(half(q), half(k), half(v), seq_lens, SELF_SP, amp)
    else:
        y = attention_op(q, k, v, seq_lens, SELF, amp)
    x = _gated_add(x, sa.o(y.flatten(2)), seg_idx, e[2])

    # cross-attention (WanCrossAttention.forward, keys and values from the prelude) and FFN
    ca = block.cross_attn
    q = ca.norm_q(ca.q(block.norm3(x))).view(b, -1, ca.num_heads, ca.head_dim)
    x = x + ca.o(attention_op(q, context_k, context_v, context_lens, CROSS, amp).flatten(2))
    y = block.ffn(_modulate(block.norm2(x).float(), seg_idx, e[3], e[4]))
    return _gated_add(x, y, seg_idx, e[5])


def _cache_counts() -> dict[str, int]:
    """torch's counts of its compile caches' answers in this process: AOTAutograd's
    (``autograd_cache_hit`` / ``_miss`` / ``_bypass``) and inductor's graph cache's
    (``fxgraph_cache_hit`` / ``_miss`` / ``_bypass``)."""
    from torch._dynamo.utils import counters
    return {k: v for group in ("aot_autograd", "inductor") for k, v in counters[group].items()
            if k.startswith(("autograd_cache_", "fxgraph_cache_"))}


class Compiled:
    """The compiled body and what it has compiled (one per process)."""

    def __init__(self, sp_dtype: torch.dtype, on_compile: Optional[Callable[[dict], None]] = None):
        self.sp_dtype = sp_dtype
        self.on_compile = on_compile
        self.body = torch.compile(_body, fullgraph=True, dynamic=False)
        self.seen: set[tuple] = set()  # the specializations compiled so far
        #: a context manager factory around a new specialization's first call (the worker's
        #: ``compile`` stage, so its seconds land in the stage timings); None: nothing around it
        self.around: Optional[Callable[[], contextlib.AbstractContextManager]] = None

    def forward(self, block, x, e, seq_lens, grid_sizes, freqs, context, context_lens):
        seg = min(max(0, int(e[1])), x.size(1))  # upstream: e[1].item(), clamped
        # block 0 of a sequence-parallel rank gets its chunk as a view of the whole sequence: its
        # strides would compile a second graph (dynamo guards on strides); the values are the same
        x = x.contiguous()
        sp = getattr(block.self_attn.forward, "__func__", None) is not type(block.self_attn).forward
        k, v = context_cache.keys_values(block.cross_attn, context, x.size(0))  # the memo's, or projected
        freqs_real = torch.view_as_real(freqs) if freqs.is_complex() else freqs
        # the autocast the attention runs under in eager (the loop's bf16 on CUDA), for the op
        dev = x.device.type
        amp = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        key = (tuple(x.shape), seg, sp, str(x.dtype), str(x.device), str(amp))
        args = (block, x, e[0], seg, seq_lens, freqs_real, k, v, context_lens, sp, self.sp_dtype, amp)
        if key in self.seen:
            return self.body(*args)
        with (self.around() if self.around is not None else contextlib.nullcontext()):
            before = _cache_counts()
            t0 = time.perf_counter()
            out = self.body(*args)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            seconds = time.perf_counter() - t0
            self.seen.add(key)
            after = _cache_counts()
            info = {"tokens": int(x.shape[1]), "segment": seg, "sequence_parallel": sp, "seconds": round(seconds, 2),
                    "cache_dir": str(cache_dir()),
                    "cache": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}}
            log.info("compiled the DiT block for %d tokens (segment %d): %.1f s", x.shape[1], seg, seconds)
            if self.on_compile is not None:
                self.on_compile(info)
        return out


_state: dict = {}


def apply(wan_module, sp_dtype: torch.dtype, on_compile: Optional[Callable[[dict], None]] = None,
          cache=None) -> Compiled:
    """Compile the S2V block class's forward (every instance, FSDP-wrapped or not). Idempotent.
    ``cache``: inductor's cache directory (the run's ``cache_dir`` setting's; None: the
    environment's rule), unless ``$TORCHINDUCTOR_CACHE_DIR`` names one."""
    cls = wan_module.modules.s2v.model_s2v.WanS2VAttentionBlock
    if _UPSTREAM in cls.__dict__:
        compiled = _state["compiled"]
        compiled.on_compile = on_compile or compiled.on_compile
        return compiled
    os.environ.setdefault(CACHE_ENV, str(cache or cache_dir()))
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)
    marked = torch._inductor.config.unsafe_marked_cacheable_functions
    _state["marked"] = [n for n in AUTOCAST_NODES if n not in marked]
    marked.update(dict.fromkeys(_state["marked"], torch.__version__))
    compiled = Compiled(sp_dtype, on_compile)
    upstream = cls.forward

    def forward(self, x, e, seq_lens, grid_sizes, freqs, context, context_lens):
        return compiled.forward(self, x, e, seq_lens, grid_sizes, freqs, context, context_lens)

    setattr(cls, _UPSTREAM, upstream)
    cls.forward = forward
    _state["compiled"] = compiled
    return compiled


def restore(wan_module) -> bool:
    """Undo :func:`apply` (tests; a process that goes back to eager)."""
    cls = wan_module.modules.s2v.model_s2v.WanS2VAttentionBlock
    if _UPSTREAM not in cls.__dict__:
        return False
    cls.forward = cls.__dict__[_UPSTREAM]
    delattr(cls, _UPSTREAM)
    _state.pop("compiled", None)
    for name in _state.pop("marked", []):
        torch._inductor.config.unsafe_marked_cacheable_functions.pop(name, None)
    return True
