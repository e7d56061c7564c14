"""Patch: the DiT's big Linears hold float8_e4m3fn weights, one scale per output row (``--dit-quant fp8``).

Upstream: every ``nn.Linear`` of ``WanModel_S2V`` holds its weight in the param dtype (bf16 on a
GPU, fp32 on the CPU): 32.6 GB for the S2V-14B DiT in bf16.
Change: :func:`convert` replaces, on the model built on meta (before any weight is read), the
block Linears (self- and cross-attention q/k/v/o, the FFN's two) and the audio injection's
q/k/v/o with :class:`Fp8Linear`. Its weight lives in a child :class:`Fp8Weight`: ``weight``
[out, in] in float8_e4m3fn and ``scale`` [out, 1] in float32 (a non-persistent buffer), and its
forward returns ``(weight.float() * scale).to(dtype)`` (into one float32 copy): the weight is dequantized per call, on
any device, and the matrix product is upstream's ``F.linear`` in the run's dtype. Everything
else (modulation, embeddings, norms, biases, the audio encoder, the frame packer, the head) is
unchanged.

With ``--fp8-matmul scaled-mm`` (:func:`set_matmul`; the rule in
:func:`wan_s2v_runner.shared.quant.choose_fp8_matmul`) the Linear multiplies in fp8 instead:
its input, in the dtype F.linear would compute in (autocast's), is quantized to e4m3 with one
scale per token (row), and ``torch._scaled_mm`` multiplies the two fp8 operands with both row
scales into that dtype; the bias is added after. One token's numbers depend only on that token,
so sequence-parallel ranks compute what one process computes.

Under FSDP each :class:`Fp8Weight` is its own unit (a flat parameter holds one dtype; the block's
unit keeps the biases and norms): :func:`own_fsdp_units` widens upstream ``shard_model``'s wrap
policy while it runs. FSDP's mixed precision casts the fp8 shard to the param dtype before the
all-gather, which is exact (every e4m3 value is a bf16 and an fp32 value), so a sharded layout
dequantizes the same numbers as one process. The scales are replicated buffers (10.6 MB at real
size), filled by :func:`set_scales` after the weights are read
(:mod:`wan_s2v_runner.loading.quantize` makes both).

Proof: tests/test_fp8.py (every layout with fp8 equals one rank exactly; an fp8 file is used as
it is; the quantized values and the distance to full precision).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from wan_s2v_runner.shared.quant import (
    DEQUANT_FIX,
    E4M3_MAX,
    FP8_LINEARS,
    Fp8Matmul,
    Fp8MatmulUnavailable,
    choose_fp8_matmul,
)

__all__ = ["E4M3_MAX", "Fp8Linear", "Fp8Weight", "convert", "own_fsdp_units", "quantized_name", "resolve_matmul",
           "scaled_mm_linear", "set_matmul", "set_scales"]
QWEIGHT = "qweight"


def quantized_name(weight_name: str) -> str:
    """``blocks.0.ffn.0.weight`` -> ``blocks.0.ffn.0.qweight.weight`` (the fp8 parameter's name)."""
    return f"{weight_name.removesuffix('.weight')}.{QWEIGHT}.weight"


class Fp8Weight(nn.Module):
    """A Linear's weight in float8_e4m3fn with one float32 scale per output row."""

    def __init__(self, out_features: int, in_features: int, device=None):
        super().__init__()
        # on meta this costs nothing; a model in memory gets its quantized weight assigned (convert)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.register_buffer("scale", torch.empty(out_features, 1, dtype=torch.float32, device=device),
                             persistent=False)
        self.source_name = ""  # the full-precision weight's name (set by convert)

    def forward(self, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """The weight dequantized into ``dtype``; with None the e4m3 values themselves (for
        ``torch._scaled_mm``). Called as a module so that FSDP gathers the weight first."""
        if dtype is None:
            # FSDP gathers the shard in the param dtype (e4m3 values, exactly): back to e4m3, a copy
            # that outlives the gathered storage FSDP frees after this call
            w = self.weight
            if isinstance(w, nn.Parameter) and w.dtype == torch.float8_e4m3fn:
                return w  # this module's own weight (no FSDP): lives as long as the module
            return w.to(torch.float8_e4m3fn, copy=True)
        # a fresh float32 copy scaled in place: under FSDP on the CPU the gathered weight is float32
        # already, and .float() would be the parameter itself
        return self.weight.to(torch.float32, copy=True).mul_(self.scale).to(dtype)


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an :class:`Fp8Weight`; the bias stays in the param dtype."""

    def __init__(self, linear: nn.Linear, allocate: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # allocate=False: a placeholder on meta, replaced by the quantized weight (convert)
        self.qweight = Fp8Weight(linear.out_features, linear.in_features,
                                 device=linear.weight.device if allocate else torch.device("meta"))
        self.bias = linear.bias
        self.dtype = linear.weight.dtype
        self.matmul = Fp8Matmul.DEQUANT  # set_matmul: the run's resolved --fp8-matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is Fp8Matmul.SCALED_MM:
            return scaled_mm_linear(x, self.qweight, self.bias)
        return F.linear(x, self.qweight(self.bias.dtype if self.bias is not None else self.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float8_e4m3fn"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D activation [tokens, in] -> (e4m3 values, float32 scales [tokens, 1]): each row's largest
    magnitude maps to 448. The division runs in ``x``'s dtype (no float32 copy of a bf16 input) by
    the scale rounded to that dtype, and that rounded scale is the one returned."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(x.dtype)
    q = (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def scaled_mm_linear(x: torch.Tensor, qweight: Fp8Weight, bias) -> torch.Tensor:
    """``F.linear(x, W, bias)`` as fp8 x fp8 with ``torch._scaled_mm`` (``--fp8-matmul scaled-mm``):
    ``x`` quantized per token in the dtype F.linear would compute in (autocast's when it is on),
    the result in that dtype."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    w = qweight(None)
    x2 = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()  # _scaled_mm's first operand: row-major
    xq, x_scale = quantize_rows(x2)
    out = torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=qweight.scale.reshape(1, -1), out_dtype=dtype)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.reshape(*x.shape[:-1], w.shape[0])


def resolve_matmul(requested, device: torch.device) -> tuple[Fp8Matmul, str]:
    """``(matmul, reason)`` for the fp8 Linears on ``device``, by the one rule
    (:func:`wan_s2v_runner.shared.quant.choose_fp8_matmul`) on this GPU's own compute capability;
    a scaled-mm on CUDA is also tried once on a tiny product (row-wise scaling is not in every
    torch build for every architecture): :class:`Fp8MatmulUnavailable` at load, not mid-denoise."""
    cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    way, why = choose_fp8_matmul(requested, device.type, cc)
    if way is Fp8Matmul.SCALED_MM and device.type == "cuda":
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        ones = torch.ones(16, 1, device=device)
        try:
            torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t().contiguous(), out_dtype=torch.bfloat16)
        except RuntimeError as e:
            raise Fp8MatmulUnavailable(f"--fp8-matmul scaled-mm: torch {torch.__version__} cannot multiply fp8 with "
                                       f"row-wise scales on this GPU (cc {cc[0]}.{cc[1]}): "
                                       f"{str(e).splitlines()[0]}", DEQUANT_FIX) from e
    return way, why


def set_matmul(model: nn.Module, matmul: Fp8Matmul) -> int:
    """Every :class:`Fp8Linear` of ``model`` computes by ``matmul``; returns how many."""
    matmul = Fp8Matmul(matmul)
    n = 0
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod.matmul = matmul
            n += 1
    return n


def convert(model: nn.Module, quantize=None) -> list[str]:
    """Replace the target Linears of ``model`` with :class:`Fp8Linear`; returns the full-precision
    weight names replaced (``blocks.0.ffn.0.weight``, ...). On meta (loading) the fp8 weights are
    filled later; with ``quantize(weight, name) -> (fp8 values, scales [out, 1])`` each Linear's
    own weight is quantized now (a model already in memory)."""
    names = []
    for name, mod in list(model.named_modules()):
        if FP8_LINEARS.match(name) and isinstance(mod, nn.Linear):
            parent_name, _, leaf = name.rpartition(".")
            new = Fp8Linear(mod, allocate=quantize is None)
            new.qweight.source_name = f"{name}.weight"
            if quantize is not None:
                q, scale = quantize(mod.weight.detach(), new.qweight.source_name)
                new.qweight.weight = nn.Parameter(q, requires_grad=False)
                new.qweight.scale = scale
            setattr(model.get_submodule(parent_name), leaf, new)
            names.append(f"{name}.weight")
    return names


def set_scales(model: nn.Module, scales: dict, device: torch.device) -> int:
    """Put each :class:`Fp8Weight`'s scale (``scales[source_name]``, float32 [out, 1]) on ``device``."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Fp8Weight):
            mod.scale = scales[mod.source_name].to(device=device, dtype=torch.float32).reshape(-1, 1)
            n += 1
    return n


@contextlib.contextmanager
def own_fsdp_units(model: nn.Module):
    """While inside, upstream ``shard_model`` (``wan.distributed.fsdp``) also wraps every
    :class:`Fp8Weight` as its own FSDP unit. A model without one is wrapped as upstream does."""
    if not any(isinstance(m, Fp8Weight) for m in model.modules()):
        yield
        return
    fsdp_module = sys.modules["wan.distributed.fsdp"]
    upstream = fsdp_module.lambda_auto_wrap_policy

    def policy(module, recurse, nonwrapped_numel, lambda_fn):
        return upstream(module, recurse, nonwrapped_numel,
                        lambda_fn=lambda m: isinstance(m, Fp8Weight) or lambda_fn(m))

    fsdp_module.lambda_auto_wrap_policy = policy
    try:
        yield
    finally:
        fsdp_module.lambda_auto_wrap_policy = upstream
