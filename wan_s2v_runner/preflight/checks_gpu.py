"""Groups ``gpus`` and ``attention``: GPU count vs ranks, kernels for the GPU's architecture,
bf16 support, busy GPUs, how ``--dit-quant fp8``'s Linears multiply (``--fp8-matmul``: the run's
own rule, ``shared.quant.choose_fp8_matmul``, on the lowest compute capability in use);
flash-attn 2/3/4 health (ABI mismatch with the missing symbol, FA3's return type, FA4's kernel
compiled for this GPU), the compute capability a requested backend needs, and what
``--attention auto`` picks (the same rule as ``patches.attention.resolve_backend``: fa3 > fa4
where it measured faster > fa2 > sdpa).
"""
from __future__ import annotations

import re

from wan_s2v_runner.shared.attention_backends import (
    FA2_MIN_CC,
    FA3_CC,
    FA4_CC,
    FA4_FASTER_ON,
    BackendUnavailable,
    choose_backend,
)
from wan_s2v_runner.shared.layout import DitQuant
from wan_s2v_runner.shared.quant import Fp8Matmul, Fp8MatmulUnavailable, choose_fp8_matmul, scaled_mm_hint

from .core import fail, ok, skip, warn


def _cc(g) -> tuple[int, int]:
    c = g.get("capability") or [0, 0]
    return int(c[0]), int(c[1])


def _cc_s(g) -> str:
    a, b = _cc(g)
    return f"{a}.{b}"


def _gpu_names(gpus) -> str:
    names = sorted({g.get("name", "?") for g in gpus})
    return ", ".join(names)


# --------------------------------------------------------------------------- gpus
def check_visible(ctx):
    f = ctx.facts
    if not ctx.on_cuda:
        return skip("gpus.visible", f"--device cpu ({f.gpu_count} CUDA GPUs visible)")
    if f.gpu_count == 0:
        t = f.torch
        why = ("torch is a CPU-only build" if not t.get("cuda")
               else "torch.cuda.is_available() is False (driver/CUDA_VISIBLE_DEVICES?)")
        return fail("gpus.visible", f"no CUDA GPU visible: {why} (torch {t.get('version')})",
                    "use --device cpu (demo only), or fix the driver/CUDA_VISIBLE_DEVICES",
                    cuda_visible_devices=f.env.get("CUDA_VISIBLE_DEVICES"))
    mem = ", ".join(f"{g['total_mib'] / 1024:.0f}" for g in f.gpus)
    return ok("gpus.visible", f"{f.gpu_count} x {_gpu_names(f.gpus)} (cc {_cc_s(f.gpus[0])}, "
              f"{mem} GiB)", gpus=[g.get("name") for g in f.gpus])


def check_fp8_matmul(ctx):
    """How ``--dit-quant fp8``'s Linears will multiply on these GPUs (the run's rule); ``scaled-mm``
    on a GPU older than cc 8.9 is refused before any rank starts; a compiled dequant run on a GPU
    where scaled-mm measured faster is told so."""
    spec = ctx.spec
    if DitQuant(spec.dit_quant) is not DitQuant.FP8:
        return skip("gpus.fp8_matmul", "no --dit-quant fp8")
    device = "cuda" if ctx.on_cuda else "cpu"
    known = [g for g in (ctx.local_gpus if ctx.on_cuda else []) if g.get("capability")]
    lowest = min(known, key=_cc) if known else None
    cc = _cc(lowest) if lowest else None
    try:
        way, why = choose_fp8_matmul(spec.fp8_matmul, device, cc)
    except Fp8MatmulUnavailable as e:
        return fail("gpus.fp8_matmul", str(e) + (f" ({lowest['name']})" if lowest else ""), e.fix,
                    cc=list(cc) if cc else None)
    hint = scaled_mm_hint(device, cc, bool(spec.compile)) if way is Fp8Matmul.DEQUANT else None
    return ok("gpus.fp8_matmul", f"--fp8-matmul {way.value}: {why}" + (f"; {hint}" if hint else ""),
              fp8_matmul=way.value)


def check_count(ctx):
    f = ctx.facts
    if not ctx.on_cuda:
        return skip("gpus.count", "--device cpu")
    n = f.gpu_count
    if n == 0:
        return skip("gpus.count", "no GPU (see gpus.visible)")
    if ctx.spec.nproc > n:
        return fail("gpus.count", f"--nproc {ctx.spec.nproc} ranks on this node but only {n} GPU"
                    f"{'s' if n > 1 else ''} visible (one GPU per rank)",
                    f"use --nproc {n} or fewer (any count works: Ulysses splits heads unevenly and pads "
                    "tokens), or expose more GPUs via CUDA_VISIBLE_DEVICES",
                    nproc=ctx.spec.nproc, gpus=n)
    if ctx.spec.nproc < n:
        return ok("gpus.count", f"{ctx.spec.nproc} of {n} visible GPUs used (ranks 0..{ctx.spec.nproc - 1} -> "
                  f"GPU 0..{ctx.spec.nproc - 1})", nproc=ctx.spec.nproc, gpus=n)
    return ok("gpus.count", f"{ctx.spec.nproc} ranks = {n} GPUs", nproc=ctx.spec.nproc, gpus=n)


def _arch_supported(cc: tuple[int, int], arch_list: list[str]) -> bool:
    for a in arch_list:
        m = re.match(r"(sm|compute)_(\d+)(\d)[a-z]?$", a)
        if not m:
            continue
        maj, mnr = int(m.group(2)), int(m.group(3))
        if m.group(1) == "sm" and maj == cc[0] and mnr <= cc[1]:
            return True  # SASS runs on the same major with an equal or newer minor
        if m.group(1) == "compute" and (maj, mnr) <= cc:
            return True  # PTX is JIT-compiled for newer GPUs
    return False


def check_arch(ctx):
    gpus, arch = ctx.local_gpus, ctx.facts.torch.get("arch_list") or []
    if not ctx.on_cuda or not gpus:
        return skip("gpus.arch", "no GPU in use")
    if not arch:
        return skip("gpus.arch", "torch's CUDA arch list unknown")
    bad = [g for g in gpus if not _arch_supported(_cc(g), arch)]
    if bad:
        g = bad[0]
        return fail("gpus.arch", f"torch {ctx.facts.torch.get('version')} has no kernels for "
                    f"{g['name']} (sm_{''.join(map(str, _cc(g)))}); its arch list: {' '.join(arch)}",
                    "install a torch build that includes this GPU (e.g. the cu126 wheels keep sm_70, "
                    "cu128 adds sm_120)")
    return ok("gpus.arch", f"torch kernels cover sm_{''.join(map(str, _cc(gpus[0])))} "
              f"({' '.join(arch)})")


def check_bf16(ctx):
    """What the DiT and T5 compute in on these GPUs (``--dtype``: the run's rule,
    ``shared.precision.resolve``, on the oldest GPU in use): auto takes fp16 below cc 8.0 (no bf16
    units there); an explicit ``--dtype bf16`` on such a GPU is emulated through fp32 (warned, with
    the fix); fp32 on a GPU is slow (said so)."""
    from wan_s2v_runner.shared.precision import ComputeDtype, has_bf16

    from .memory import compute_dtype
    gpus = ctx.local_gpus
    if not ctx.on_cuda or not gpus:
        return skip("gpus.bf16", "no GPU in use")
    choice = ComputeDtype(ctx.spec.dtype)
    known = [g for g in gpus if g.get("capability")]  # an unknown capability: bf16, as the rule takes it
    oldest = min(known or gpus, key=_cc)
    cc = _cc(oldest)
    dtype, why = compute_dtype(ctx)
    if known and not has_bf16(cc):
        name = f"{oldest['name']} (cc {_cc_s(oldest)})"
        if dtype is ComputeDtype.BF16:
            return warn("gpus.bf16", f"{name} has no bf16 units: --dtype bf16 is emulated through fp32 there "
                        "(a V100: ~10 TFLOPS against ~100 in fp16) and SDPA falls to its math kernel",
                        "use --dtype fp16 (or auto: fp16 on this GPU, a few layers kept in fp32)",
                        dtype=dtype.value, cc=list(cc))
        if dtype is ComputeDtype.FP32:
            return warn("gpus.bf16", f"{name} computes the DiT and T5 in fp32 (--dtype fp32): its fp32 rate "
                        "is a fraction of its fp16 tensor cores'", "use --dtype auto (fp16 on this GPU)",
                        dtype=dtype.value, cc=list(cc))
        return ok("gpus.bf16", f"cc {_cc_s(oldest)} has no bf16 units: "
                  + ("--dtype auto computes in fp16" if choice is ComputeDtype.AUTO else "--dtype fp16")
                  + " (a few layers stay fp32; a non-finite activation stops the job: docs/loading.md)",
                  dtype=dtype.value, cc=list(cc))
    if dtype is ComputeDtype.BF16:
        return ok("gpus.bf16", f"native bf16 (cc {_cc_s(oldest)})", dtype=dtype.value, cc=list(cc))
    return ok("gpus.bf16", f"native bf16 (cc {_cc_s(oldest)}); {why}", dtype=dtype.value, cc=list(cc))


def check_busy(ctx):
    gpus = ctx.local_gpus
    if not ctx.on_cuda or not gpus:
        return skip("gpus.busy", "no GPU in use")
    busy = [(g, g["total_mib"] - g["free_mib"]) for g in gpus
            if g.get("free_mib") is not None and g["total_mib"] - g["free_mib"] > 2048]
    if busy:
        desc = ", ".join(f"GPU {g['index']}: {used / 1024:.1f} GiB" for g, used in busy)
        return warn("gpus.busy", f"memory already in use by other processes ({desc})",
                    "stop the other jobs or pick idle GPUs with CUDA_VISIBLE_DEVICES")
    return ok("gpus.busy", "GPUs idle (< 2 GiB in use each)")


# --------------------------------------------------------------------------- attention
def _fa_fix(ctx) -> str:
    t = ctx.facts.torch
    return (f"rebuild flash-attn for torch {t.get('version')} (pip install flash-attn "
            "--no-build-isolation --force-reinstall), or use --attention sdpa")


def check_fa2(ctx):
    a = ctx.facts.attention.get("fa2") or {}
    wanted = ctx.spec.attention == "fa2"
    if not ctx.on_cuda:
        return skip("attention.fa2", "--device cpu: flash-attn kernels are CUDA-only")
    if not a.get("installed"):
        if wanted:
            return fail("attention.fa2", "--attention fa2 but flash-attn is not installed",
                        "pip install flash-attn --no-build-isolation (Ampere+), or --attention sdpa")
        return ok("attention.fa2", "flash-attn 2 not installed (auto falls back to SDPA)")
    err = a.get("import_error") or ""
    m = re.search(r"undefined symbol:\s*(\S+)", err) or re.search(r"undefined symbol\s+(\S+)\)?", a.get("reason", ""))
    mk = fail if wanted else warn
    if m:
        return mk("attention.fa2", f"flash-attn {a['installed']} ABI mismatch: its CUDA extension was "
                  f"built for another torch (undefined symbol {m.group(1).rstrip(')')})", _fa_fix(ctx),
                  symbol=m.group(1).rstrip(")"))
    if err:
        return mk("attention.fa2", f"flash-attn {a['installed']} does not import: {err}", _fa_fix(ctx))
    if not a.get("usable"):
        return mk("attention.fa2", f"flash-attn {a['installed']} imports but is not usable: "
                  f"{a.get('reason', '?')}", _fa_fix(ctx))
    return ok("attention.fa2", f"flash-attn {a['installed']} imports and runs on this GPU")


def check_fa3(ctx):
    a = ctx.facts.attention.get("fa3") or {}
    wanted = ctx.spec.attention == "fa3"
    if not ctx.on_cuda:
        return skip("attention.fa3", "--device cpu")
    if not a.get("installed"):
        if wanted:
            return fail("attention.fa3", "--attention fa3 but flash_attn_interface (FA3) is not installed",
                        "build FA3 from flash-attention/hopper on an sm90 GPU, or --attention fa2/sdpa")
        return ok("attention.fa3", "FA3 not installed (Hopper-only; optional)")
    if not a.get("usable"):
        mk = fail if wanted else warn
        why = a.get("reason") or a.get("import_error")
        return mk("attention.fa3", f"FA3 {a['installed']} present but not usable: {why}",
                  "rebuild FA3 for this torch on an sm90 GPU, or --attention fa2/sdpa")
    ret = a.get("returns")
    note = (f"its varlen function returns a {ret}" if ret else "return type not probed")
    return ok("attention.fa3", f"FA3 {a['installed']} usable; {note} — upstream indexes [0] (wrong "
              "for a bare Tensor), patches.attention handles both", returns=ret)


def check_fa4(ctx):
    a = ctx.facts.attention.get("fa4") or {}
    wanted = ctx.spec.attention == "fa4"
    if not ctx.on_cuda:
        return skip("attention.fa4", "--device cpu")
    faster = ", ".join(f"cc {c[0]}.{c[1]}" for c in FA4_FASTER_ON) or "no GPU yet"
    if not a.get("installed"):
        if wanted:
            return fail("attention.fa4", "--attention fa4 but flash-attn-4 (flash_attn.cute) is not installed",
                        "pip install flash-attn-4 'nvidia-cutlass-dsl[cu13]' (SM90/SM100), or --attention auto/sdpa")
        return ok("attention.fa4", f"flash-attn-4 not installed (optional; auto takes it where it measured "
                  f"faster than SDPA: {faster})")
    if not a.get("usable"):
        mk = fail if wanted else warn
        why = a.get("reason") or a.get("import_error")
        return mk("attention.fa4", f"flash-attn-4 {a['installed']} present but not usable: {why}",
                  "pip install flash-attn-4 with the nvidia-cutlass-dsl build for this CUDA (the [cu13] extra "
                  "for a CUDA 13 torch) on an SM90/SM100 GPU, or --attention auto/sdpa")
    return ok("attention.fa4", f"flash-attn-4 {a['installed']} compiles and runs on this GPU (auto takes it "
              f"where it measured faster than SDPA: {faster})")


def check_capability(ctx):
    gpus = ctx.local_gpus
    if not ctx.on_cuda or not gpus:
        return skip("attention.capability", "no GPU in use")
    lowest = min(gpus, key=_cc)
    cc = _cc(lowest)
    if ctx.spec.attention == "fa2" and cc < FA2_MIN_CC:
        return fail("attention.capability", f"--attention fa2 needs compute capability >= 8.0; "
                    f"{lowest['name']} is {_cc_s(lowest)}", "use --attention sdpa (or auto)", cc=list(cc))
    if ctx.spec.attention == "fa3" and cc != FA3_CC:
        return fail("attention.capability", f"--attention fa3 needs a Hopper GPU (cc 9.0); "
                    f"{lowest['name']} is {_cc_s(lowest)}", "use --attention fa2 (Ampere+) or sdpa", cc=list(cc))
    if ctx.spec.attention == "fa4" and cc not in FA4_CC:
        return fail("attention.capability", f"--attention fa4 needs an SM90 or SM100 GPU (cc 9.0, 10.0, 10.3); "
                    f"{lowest['name']} is {_cc_s(lowest)}", "use --attention auto or sdpa", cc=list(cc))
    if cc < FA2_MIN_CC:
        return ok("attention.capability", f"cc {_cc_s(lowest)} < 8.0: no flash-attn, SDPA will be used",
                  cc=list(cc))
    also = [n for n, yes in (("FA3", cc == FA3_CC), ("FA4", cc in FA4_CC)) if yes]
    return ok("attention.capability", f"cc {_cc_s(lowest)} supports FA2" + "".join(f" and {n}" for n in also),
              cc=list(cc))


def predict_backend(ctx) -> tuple[str, str]:
    """(backend, reason) the run's ``--attention`` resolves to on this machine: the run's own rule
    (``attention_backends.choose_backend``) on the recorded availability and the lowest compute
    capability of the GPUs in use; ("", cause) when an explicit backend cannot run."""
    cc = min((_cc(g) for g in ctx.local_gpus), default=None)
    t = ctx.facts.torch
    try:
        return choose_backend(ctx.spec.attention, "cuda" if ctx.on_cuda else "cpu", ctx.facts.attention,
                              cc, torch_version=t.get("version"), cuda_version=t.get("cuda"))
    except BackendUnavailable as e:
        return "", e.cause


def check_backend(ctx):
    backend, reason = predict_backend(ctx)
    if not backend:
        return fail("attention.backend", f"--attention {ctx.spec.attention}: {reason}",
                    "use --attention auto or sdpa")
    cc = min((_cc(g) for g in ctx.local_gpus if g.get("capability")), default=None) if ctx.on_cuda else None
    from wan_s2v_runner.shared.precision import ComputeDtype, has_bf16
    if backend == "sdpa" and cc is not None and not has_bf16(cc):
        # no flash kernel below sm80; the memory-efficient one (sm50+) takes fp16/fp32 only
        from .memory import compute_dtype
        dtype, _ = compute_dtype(ctx)
        if dtype is ComputeDtype.BF16:
            return warn("attention.backend", f"--attention {ctx.spec.attention} -> sdpa ({reason}); on cc "
                        f"{cc[0]}.{cc[1]} SDPA has no flash kernel and its memory-efficient kernel takes fp16/fp32 "
                        "only: bf16 attention falls to the math kernel (the whole score matrix in memory)",
                        "use --dtype fp16 (or auto)", backend=backend, kernel="math")
        return ok("attention.backend", f"--attention {ctx.spec.attention} -> sdpa ({reason}); on cc "
                  f"{cc[0]}.{cc[1]}: SDPA's memory-efficient kernel in {dtype.value} (no flash kernel below sm80)",
                  backend=backend, kernel="memory-efficient")
    return ok("attention.backend", f"--attention {ctx.spec.attention} -> {backend} ({reason})",
              backend=backend)
