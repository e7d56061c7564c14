"""Which attention backend a run uses: flash-attn availability, measured live, and the one rule.

Two halves, used by both the run and the doctor so they cannot disagree:

* :func:`measure_availability` measures, on this machine and in this process, one record per
  flash-attn backend (``fa4`` = FlashAttention-4, module ``flash_attn.cute``, the CuTe-DSL kernels
  of PyPI's ``flash-attn-4``, compiled for the GPU at their first call; ``fa3`` = FlashAttention-3,
  module ``flash_attn_interface``; ``fa2`` = FlashAttention-2, module ``flash_attn``)::

      {"installed": "2.8.3" | "unknown" | None,  # distribution version (None: not installed)
       "import_error": "ImportError: ..." | None,  # raw first line, when the import fails
       "usable": bool,                             # imports AND a tiny varlen kernel call ran
       "reason": "...",                            # one line: why (not) usable
       "returns": "tuple" | "tensor"}              # fa3 only, when usable: varlen return type

  The probe records it in the machine facts (``facts["attention"]``, recorded machines in
  ``tests/data/machines/``); the attention patch measures it at run time.
* :func:`choose_backend` is pure: from the requested backend (``auto|fa4|fa3|fa2|sdpa``), the
  device type, such an availability mapping and the GPU's compute capability it returns
  ``(backend, reason)``: ``auto`` on CUDA picks fa3 > fa4 > fa2 > sdpa, where fa4 only on the
  compute capabilities where it measured faster than SDPA at S2V's shape (:data:`FA4_FASTER_ON`,
  docs/gpu.md); FA4 needs SM90 or SM100 (cc 9.0, 10.0, 10.3), FA3 cc 9.0 (Hopper), FA2 cc >= 8.0
  (Ampere+); any other device gets sdpa; an explicit fa4/fa3/fa2 that cannot run raises
  :class:`BackendUnavailable` (cause + fix). ``patches.attention.resolve_backend`` calls it on a
  live measurement, the doctor's ``predict_backend`` on recorded facts.

Also here, because it decides availability too: :func:`guard_flash_attn_imports`, which must run
before ``import wan`` — upstream catches only ModuleNotFoundError around the flash-attn imports,
so a wheel built for another torch (``undefined symbol``: ABI mismatch) would crash ``import wan``;
the guard parks ``None`` in ``sys.modules`` for such a module and remembers why. (FA4 is not
guarded: the engine never imports it, and importing it loads the CuTe DSL, which only a run that
asks for it should pay.)
Importing this module imports neither torch nor flash-attn (measuring does, lazily).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import importlib.util
import logging
import re
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

BACKENDS = ("fa4", "fa3", "fa2", "sdpa")
REQUESTS = ("auto",) + BACKENDS
#: flash-attn backends in the order ``auto`` tries them (fa4 only where :data:`FA4_FASTER_ON` says)
FLASH_BACKENDS = ("fa3", "fa4", "fa2")
#: the backends whose modules the engine imports itself (and so the guard checks before ``import wan``)
ENGINE_IMPORTED = ("fa3", "fa2")
FA2_MIN_CC = (8, 0)  # FlashAttention-2: Ampere or newer
FA3_CC = (9, 0)  # FlashAttention-3: Hopper only
#: FlashAttention-4 (CuTe DSL): its forward kernels for SM90 (Hopper) and SM100/SM103 (Blackwell
#: B200/B300); flash_attn.cute also has SM80/SM120 paths, which its authors do not call supported
FA4_CC = ((9, 0), (10, 0), (10, 3))
#: where ``auto`` takes FA4: the compute capabilities on which one real-size S2V step measured
#: faster with FA4 than with SDPA (PyTorch's cuDNN kernel) on the same machine (docs/gpu.md,
#: "FA4 against cuDNN": cc 9.0, an H100, 2026-11-27: the eager step 0.95x, the self-attention call
#: 0.92x); elsewhere (Blackwell not measured) auto keeps SDPA and FA4 runs only when asked for
FA4_FASTER_ON: tuple[tuple[int, int], ...] = ((9, 0),)

FA_MODULES = {"fa4": "flash_attn.cute", "fa3": "flash_attn_interface", "fa2": "flash_attn"}  # import names
FA_DISTS = {"fa4": "flash-attn-4", "fa3": "flash_attn_3", "fa2": "flash-attn"}  # distribution names
FA_NAMES = {"fa4": "flash-attn 4 (flash_attn.cute)", "fa3": "flash-attn 3 (flash_attn_interface)",
            "fa2": "flash-attn 2 (flash_attn)"}
_FA_FIX = {
    "fa4": "pip install flash-attn-4 'nvidia-cutlass-dsl[cu13]' (a CUDA 13 torch; plain nvidia-cutlass-dsl "
           "for CUDA 12) on an SM90 or SM100 GPU",
    "fa3": "build FA3 from flash-attention/hopper for torch {torch} on an sm90 GPU",
    "fa2": "pip install flash-attn built for torch {torch}{cuda} (Ampere or newer GPU)",
}
SDPA_EXPLICIT = "requested explicitly (torch scaled_dot_product_attention)"

# module name -> (raw first line, described reason), filled by guard_flash_attn_imports()
_IMPORT_FAILURES: dict[str, tuple[str, str]] = {}


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here. ``str()``: ``"<cause>. Fix: <fix>"``."""

    def __init__(self, backend: str, cause: str, fix: str):
        super().__init__(f"{cause}. Fix: {fix}")
        self.backend, self.cause, self.fix = backend, cause, fix


# --------------------------------------------------------------------------- import health
def _raw_import_error(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def describe_import_error(err: BaseException) -> str:
    """One line for a failed flash-attn import; names the missing symbol of an ABI mismatch."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    m = re.search(r"undefined symbol:\s*(\S+)", str(err))
    if m:
        return (f"ABI mismatch: its CUDA extension was built for another torch "
                f"(undefined symbol {m.group(1)})")
    return f"{type(err).__name__}: {msg}"


def guard_flash_attn_imports() -> dict[str, str]:
    """Call BEFORE ``import wan``. For each installed-but-broken flash-attn module (ABI mismatch
    -> ImportError "undefined symbol", or any other import-time error) park ``None`` in
    ``sys.modules``, so upstream's import raises ModuleNotFoundError and treats the backend as
    unavailable. Returns {module: reason} for the modules it parked. Absent modules are left
    alone. Idempotent."""
    for name in (FA_MODULES[b] for b in ENGINE_IMPORTED):
        if name in sys.modules:  # already imported (works) or already parked
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # simply not installed: upstream handles that
                continue
            _IMPORT_FAILURES[name] = (_raw_import_error(e), describe_import_error(e))
            sys.modules[name] = None  # type: ignore[assignment]
        except Exception as e:  # ImportError (undefined symbol), OSError, RuntimeError, ...
            _IMPORT_FAILURES[name] = (_raw_import_error(e), describe_import_error(e))
            sys.modules[name] = None  # type: ignore[assignment]
    for name, (_, why) in _IMPORT_FAILURES.items():
        log.warning("%s is installed but unusable (%s); treating it as absent", name, why)
    return {name: why for name, (_, why) in _IMPORT_FAILURES.items()}


# --------------------------------------------------------------------------- live measurement
def _import_varlen(backend: str) -> tuple[Any, Callable]:
    """(module, its attention function) of a flash-attn backend: ``flash_attn_varlen_func``, or
    FA4's ``flash_attn_func``; raises what the import raises."""
    mod = importlib.import_module(FA_MODULES[backend])
    if backend == "fa4":
        return mod, mod.flash_attn_func
    # fa2: importing flash_attn loads flash_attn_2_cuda (via flash_attn.flash_attn_interface)
    if backend == "fa2" and not hasattr(mod, "flash_attn_varlen_func") and not getattr(mod, "__file__", None):
        raise _NamespaceOnly("not installed (flash_attn is only a namespace here: flash-attn-4's flash_attn.cute)")
    return mod, mod.flash_attn_varlen_func


class _NamespaceOnly(ModuleNotFoundError):
    """``flash_attn`` is a namespace package: flash-attn-4 alone installs ``flash_attn/cute/`` and
    no ``flash_attn/__init__.py``, so the name imports but holds no FlashAttention-2."""


def _smoke(backend: str, fn: Callable) -> str:
    """One tiny call on the current CUDA device: proves the kernel exists for this GPU (FA4's first
    call also compiles it: the CuTe DSL, a few seconds, once per process and configuration).
    fa3/fa2: varlen, head size 64, positional q, k, v as upstream calls them; fa4: dense, S2V's
    head size 128, keyword arguments only (FA4's interface grows between releases). Returns what
    the function returned: "tuple" (FA4 always: ``(out, lse)``) or "tensor"."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device())
    if backend == "fa4":
        x = torch.zeros(1, 128, 1, 128, device=dev, dtype=torch.bfloat16)
        out = fn(q=x, k=x, v=x, causal=False)
    else:
        x = torch.zeros(4, 1, 64, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=dev)
        out = fn(x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2, max_seqlen_k=2)
    returns = "tuple" if isinstance(out, (tuple, list)) else "tensor"
    if returns == "tuple":
        out = out[0]
    if tuple(out.shape) != tuple(x.shape):
        raise RuntimeError(f"unexpected output shape {tuple(out.shape)}")
    torch.cuda.synchronize(dev)
    return returns


def _parked_package(name: str) -> Optional[str]:
    """The module the guard parked that ``name`` is or lies in (``flash_attn`` for
    ``flash_attn.cute``), or None."""
    parts = name.split(".")
    return next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in _IMPORT_FAILURES),
                None)


def _findable(name: str) -> bool:
    """Whether ``name`` (``flash_attn.cute`` too: its parent may be absent) can be imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - its parent is installed but fails to import: the import says why
        return True


@functools.lru_cache(maxsize=None)
def _measure(backend: str, device_type: str) -> tuple[tuple[str, Any], ...]:
    """One backend's availability record (as items, so the cache hands out copies)."""
    name = FA_MODULES[backend]
    info: dict[str, Any] = {"installed": None, "import_error": None, "usable": False}
    try:
        info["installed"] = md.version(FA_DISTS[backend])
    except md.PackageNotFoundError:
        pass
    parked = _parked_package(name)
    if parked == name:  # parked by the guard: find_spec would now say "absent"
        info["installed"] = info["installed"] or "unknown"
        info["import_error"], info["reason"] = _IMPORT_FAILURES[name]
        return tuple(info.items())
    if parked:  # inside a package the guard parked (FA4's flash_attn.cute in a broken FA2's flash_attn)
        owner = next(b for b, m in FA_MODULES.items() if m == parked)
        info["installed"] = info["installed"] or "unknown"
        info["import_error"] = _IMPORT_FAILURES[parked][0]
        info["reason"] = (f"blocked by the broken {FA_NAMES[owner]} in the same package "
                          f"({_IMPORT_FAILURES[parked][1]}): rebuild or uninstall {FA_DISTS[owner]}")
        return tuple(info.items())
    if sys.modules.get(name) is None and not _findable(name):
        info["reason"] = "not installed"
        return tuple(info.items())
    info["installed"] = info["installed"] or "unknown"
    fn = None
    try:
        mod, fn = _import_varlen(backend)
    except _NamespaceOnly as e:
        info["installed"], info["reason"] = None, str(e)
    except Exception as e:  # noqa: BLE001 - an ABI mismatch is an ImportError
        info["import_error"] = _raw_import_error(e)
        info["reason"] = describe_import_error(e)
    if fn is None:
        return tuple(info.items())
    if device_type != "cuda":
        info["reason"] = "flash-attn kernels are CUDA-only (no GPU)"
        return tuple(info.items())
    import torch

    if not torch.cuda.is_available():
        info["reason"] = "torch.cuda.is_available() is False"
        return tuple(info.items())
    try:
        returns = _smoke(backend, fn)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        info["reason"] = f"kernel call failed on this GPU: {describe_import_error(e)}"
        return tuple(info.items())
    ver = getattr(mod, "__version__", None) or info["installed"]
    info["usable"], info["reason"] = True, f"{FA_NAMES[backend]} {ver} imports and runs on this GPU"
    if backend == "fa3":
        info["returns"] = returns
    return tuple(info.items())


def measure_availability(device_type: str = "cuda",
                         backends: Sequence[str] = FLASH_BACKENDS) -> dict[str, dict[str, Any]]:
    """{"fa3": record, "fa4": record, "fa2": record} for this machine and process (see the module
    docstring); ``backends``: only these.

    Imports flash-attn (lazily, here only) and, on ``device_type == "cuda"`` with a GPU, runs one
    tiny kernel call per importable backend on the current device (this creates a CUDA context;
    FA4's first call compiles its kernel). Measured once per process and device type; each call
    returns fresh dicts."""
    return {b: dict(_measure(b, device_type)) for b in backends}


def cuda_capability() -> Optional[tuple[int, int]]:
    """Compute capability of the current CUDA device, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return int(major), int(minor)


# --------------------------------------------------------------------------- the rule
def _cc_s(cc: Sequence[int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def runs_here(backend: str, info: Mapping[str, Any],
              capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """(whether ``backend`` with this availability record runs on a GPU of ``capability``, why)."""
    if not info.get("usable"):
        return False, info.get("reason") or info.get("import_error") or "availability not measured"
    if capability is not None:
        has = f"the GPU has {_cc_s(capability)}"
        if backend == "fa3" and capability != FA3_CC:
            return False, f"needs compute capability {_cc_s(FA3_CC)} (Hopper), {has}"
        if backend == "fa4" and capability not in FA4_CC:
            return False, (f"needs compute capability {' or '.join(_cc_s(c) for c in FA4_CC)} "
                           f"(SM90 Hopper, SM100 Blackwell), {has}")
        if backend == "fa2" and capability < FA2_MIN_CC:
            return False, f"needs compute capability >= {_cc_s(FA2_MIN_CC)}, {has}"
    return True, info.get("reason") or "usable"


def auto_candidates(capability: Optional[Sequence[int]],
                    faster_on: Sequence[Sequence[int]] = FA4_FASTER_ON) -> tuple[str, ...]:
    """The flash-attn backends ``auto`` tries on a GPU of ``capability``, in order: FA4 only where
    it measured faster than SDPA (``faster_on``; unknown capability: not tried)."""
    fa4 = capability is not None and tuple(int(c) for c in capability) in {tuple(c) for c in faster_on}
    return tuple(b for b in FLASH_BACKENDS if b != "fa4" or fa4)


def choose_backend(requested: Optional[str], device_type: str,
                   availability: Mapping[str, Mapping[str, Any]],
                   capability: Optional[Sequence[int]], *, torch_version: Optional[str] = None,
                   cuda_version: Optional[str] = None,
                   fa4_faster_on: Sequence[Sequence[int]] = FA4_FASTER_ON) -> tuple[str, str]:
    """(backend, reason) for ``requested`` in auto|fa4|fa3|fa2|sdpa (case-insensitive; None = auto).

    ``availability``: per-backend records as :func:`measure_availability` returns them (live) or
    the facts hold them (recorded); missing records count as not usable. ``capability``: the
    (lowest) compute capability of the GPUs that will run, None if unknown (not checked then).
    auto: CUDA -> fa3 if usable and cc 9.0, else fa4 if usable and measured faster on this cc
    (``fa4_faster_on``), else fa2 if usable and cc >= 8.0, else sdpa; any other device -> sdpa.
    fa4/fa3/fa2 explicitly: :class:`BackendUnavailable` if they cannot run. sdpa: always. Unknown
    names: ValueError. ``torch_version``/``cuda_version`` only fill in the fix text."""
    req = (requested or "auto").lower()
    if req not in REQUESTS:
        raise ValueError(f"unknown attention backend {requested!r}; choose from " + ", ".join(REQUESTS))
    if req == "sdpa":
        return "sdpa", SDPA_EXPLICIT
    if device_type != "cuda":
        if req == "auto":
            return "sdpa", f"device is {device_type}: flash-attn kernels are CUDA-only"
        raise BackendUnavailable(req, f"{FA_NAMES[req]} needs a CUDA device, this run is on "
                                 f"{device_type}", "use --attention sdpa (or auto)")
    cc = (int(capability[0]), int(capability[1])) if capability is not None else None
    fails = []
    for cand in (auto_candidates(cc, fa4_faster_on) if req == "auto" else (req,)):
        ok, why = runs_here(cand, availability.get(cand) or {}, cc)
        if ok:
            return cand, why
        if req == cand:
            fix = _FA_FIX[cand].format(torch=torch_version or "this torch",
                                       cuda=f" / CUDA {cuda_version}" if cuda_version else "")
            raise BackendUnavailable(cand, f"{FA_NAMES[cand]} is not usable: {why}",
                                     f"{fix}, or use --attention sdpa")
        fails.append(f"{cand}: {why}")
    return "sdpa", "no usable flash-attn (" + "; ".join(fails) + ")"
