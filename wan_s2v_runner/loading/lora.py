"""LoRA: map the keys of the LoRA files people share onto this DiT, and merge them into its weights.

Formats (told apart by their keys; the key families are public):

* **peft / DiffSynth-Studio**: ``blocks.N.self_attn.q.lora_A[.default].weight`` and ``lora_B``,
  no alpha (trained with alpha = rank: scale 1); an ``.alpha`` key, when present, is honoured.
* **kohya / VideoX-Fun**: ``lora_unet__blocks_N_self_attn_q.lora_down.weight``, ``lora_up``,
  ``.alpha`` (scale alpha / rank); module names with ``.`` written as ``_``.
* **ComfyUI / musubi-tuner**: a ``diffusion_model.`` prefix, ``lora_down/up`` or ``lora_A/B``,
  ``.alpha``, and ``.diff`` / ``.diff_b``: full weight and bias deltas.

:func:`plan` is pure: LoRA key shapes + the DiT's parameter shapes -> which DiT parameter each
term changes, and what does not match (unknown module, wrong shape, unrecognised key). Preflight
runs it on file headers (nothing loaded); the worker runs it on the loaded DiT and then
:func:`merge` adds ``strength * scale * up @ down`` (and the deltas) to the weights: accumulated
in fp32 over every LoRA, rounded once to the parameter's dtype. Merging happens before any
sharding or splitting (``patches.lora_merge``), so FSDP, Ulysses and the weight fingerprint see
ordinary, merged weights.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


class LoraFormat(str, Enum):
    PEFT = "peft"
    KOHYA = "kohya"
    COMFYUI = "comfyui"


class Part(str, Enum):
    """What a LoRA tensor is for its module."""

    DOWN = "down"  # lora_A / lora_down: [rank, in]
    UP = "up"  # lora_B / lora_up: [out, rank]
    ALPHA = "alpha"  # scalar: scale = alpha / rank
    DIFF = "diff"  # full weight delta
    DIFF_B = "diff_b"  # bias delta


#: key suffix -> part (longest first, so ".lora_A.default.weight" wins over ".weight")
SUFFIXES: tuple[tuple[str, Part], ...] = (
    (".lora_A.default.weight", Part.DOWN), (".lora_B.default.weight", Part.UP),
    (".lora_A.weight", Part.DOWN), (".lora_B.weight", Part.UP),
    (".lora_down.weight", Part.DOWN), (".lora_up.weight", Part.UP),
    (".alpha", Part.ALPHA), (".diff_b", Part.DIFF_B), (".diff", Part.DIFF),
)
COMFY_PREFIX = "diffusion_model."
KOHYA_PREFIX = "lora_unet_"
#: other wrappers trainers put in front of the DiT's own module names
OTHER_PREFIXES = ("base_model.model.", "pipe.dit.", "model.", "dit.")


@dataclass
class ModuleTerms:
    """The tensors one LoRA has for one module (source key per part)."""

    module: str  # the DiT module name (after mapping)
    keys: dict[Part, str] = field(default_factory=dict)


@dataclass
class LoraPlan:
    """What one LoRA file does to this DiT (from shapes alone)."""

    formats: list[LoraFormat]
    targets: dict[str, list[tuple[Part, ModuleTerms]]]  # DiT parameter name -> terms that change it
    matched_modules: list[str]
    unmatched: list[str]  # LoRA modules with no module of that name in this DiT
    shape_errors: list[str]  # matched by name, wrong shape
    unrecognised: list[str]  # keys that are not LoRA tensors at all

    @property
    def format(self) -> str:
        return "+".join(f.value for f in self.formats) or "unknown"

    @property
    def ok(self) -> bool:
        return not (self.unmatched or self.shape_errors or self.unrecognised) and bool(self.matched_modules)

    def refused(self, allow_partial: bool) -> bool:
        """Whether this LoRA must not run: a wrong shape or nothing matched always; keys that
        name no module (or are no LoRA tensor) unless partial LoRAs are allowed. The one rule
        preflight and the merge both apply."""
        if self.shape_errors or not self.matched_modules:
            return True
        return bool(self.unmatched or self.unrecognised) and not allow_partial

    def problems(self, limit: int = 3) -> list[str]:
        out = []
        for what, names in (("no module of that name in this DiT", self.unmatched),
                            ("wrong shape", self.shape_errors), ("not a LoRA tensor", self.unrecognised)):
            if names:
                more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
                out.append(f"{len(names)} {what}: {', '.join(names[:limit])}{more}")
        return out

    def likely_cause(self) -> str:
        names = self.unmatched + self.unrecognised
        if any(s in n for n in names for s in ("double_blocks", "single_blocks", "input_blocks", "mid_block")):
            return "it is a LoRA for another model family (Flux/SD/HunyuanVideo naming)"
        if any(s in n for n in names for s in ("attn1", "attn2", "to_q", "to_k", "transformer_blocks")):
            return "its keys use diffusers' naming (attn1/to_q): convert it to the Wan (ComfyUI) naming"
        if self.shape_errors:
            return "it was trained for a Wan model of another size (e.g. a 1.3B/5B LoRA on the 14B)"
        return "it is a LoRA for another model, or another version of this one"


def _strip(key: str) -> tuple[str, Optional[Part], Optional[LoraFormat]]:
    """key -> (module name as written in the file, part, format), or (key, None, None)."""
    part = None
    for suffix, p in SUFFIXES:
        if key.endswith(suffix):
            key, part = key[: -len(suffix)], p
            break
    if part is None:
        return key, None, None
    if key.startswith(KOHYA_PREFIX):
        return key[len(KOHYA_PREFIX):].lstrip("_"), part, LoraFormat.KOHYA
    if key.startswith(COMFY_PREFIX):
        return key[len(COMFY_PREFIX):], part, LoraFormat.COMFYUI
    for prefix in OTHER_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key, part, LoraFormat.PEFT


def plan(lora_shapes: Mapping[str, Sequence[int]], dit_shapes: Mapping[str, Sequence[int]]) -> LoraPlan:
    """Map a LoRA's keys (name -> shape) onto DiT parameters (name -> shape)."""
    modules = {n.rsplit(".", 1)[0] for n in dit_shapes}
    flat = {m.replace(".", "_"): m for m in modules}  # kohya writes module names with "_"
    groups: dict[str, ModuleTerms] = {}
    formats: Counter = Counter()
    unrecognised = []
    for key in lora_shapes:
        name, part, fmt = _strip(key)
        if part is None:
            unrecognised.append(key)
            continue
        formats[fmt] += 1
        if fmt is LoraFormat.KOHYA:
            name = flat.get(name, name)
        groups.setdefault(name, ModuleTerms(name)).keys[part] = key
    targets: dict[str, list[tuple[Part, ModuleTerms]]] = {}
    matched, unmatched, shape_errors = [], [], []
    for name, terms in sorted(groups.items()):
        if name not in modules:
            unmatched.append(name)
            continue
        err = _check_shapes(name, terms, lora_shapes, dit_shapes)
        if err:
            shape_errors.append(err)
            continue
        matched.append(name)
        if Part.DOWN in terms.keys:
            targets.setdefault(f"{name}.weight", []).append((Part.UP, terms))
        if Part.DIFF in terms.keys:
            targets.setdefault(f"{name}.weight", []).append((Part.DIFF, terms))
        if Part.DIFF_B in terms.keys:
            targets.setdefault(f"{name}.bias", []).append((Part.DIFF_B, terms))
    return LoraPlan([f for f, _ in formats.most_common()], targets, matched, unmatched, shape_errors, unrecognised)


def _check_shapes(name, terms: ModuleTerms, lora_shapes, dit_shapes) -> str:
    w = tuple(dit_shapes.get(f"{name}.weight", ()))
    k = terms.keys
    if (Part.DOWN in k) != (Part.UP in k):
        return f"{name} (has only {'lora_A/down' if Part.DOWN in k else 'lora_B/up'})"
    if Part.DOWN in k:
        down, up = tuple(lora_shapes[k[Part.DOWN]]), tuple(lora_shapes[k[Part.UP]])
        if len(w) != 2 or len(down) != 2 or len(up) != 2 or down[0] != up[1] \
                or (up[0], down[1]) != w:
            return f"{name} (LoRA {list(up)} @ {list(down)} vs weight {list(w)})"
    if Part.DIFF in k and tuple(lora_shapes[k[Part.DIFF]]) != w:
        return f"{name} (diff {list(lora_shapes[k[Part.DIFF]])} vs weight {list(w)})"
    if Part.DIFF_B in k:
        b = tuple(dit_shapes.get(f"{name}.bias", ()))
        if tuple(lora_shapes[k[Part.DIFF_B]]) != b:
            return f"{name} (diff_b {list(lora_shapes[k[Part.DIFF_B]])} vs bias {list(b)})"
    return ""


# --------------------------------------------------------------------------- files
def file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a .safetensors header (no tensor data read)."""
    from wan_s2v_runner.loading.ckpt_tables import read_safetensors_header
    return {k: shape for k, (_, shape) in read_safetensors_header(Path(path)).tensors.items()}


def rank_and_alpha(lora_shapes: Mapping[str, Sequence[int]]) -> tuple[Optional[int], bool]:
    """A LoRA's rank (its first down projection's rows; None without one) and whether it carries an
    alpha (else PEFT's scale 1 is assumed), from its key shapes."""
    rank, alpha = None, False
    for key, shape in lora_shapes.items():
        part = _strip(key)[1]
        if part is Part.ALPHA:
            alpha = True
        elif part is Part.DOWN and rank is None:
            rank = int(shape[0])
    return rank, alpha


# --------------------------------------------------------------------------- merge
def delta_for(param: str, lora_plan: LoraPlan, tensors: Mapping[str, "torch.Tensor"]) -> Optional["torch.Tensor"]:
    """The fp32 change one LoRA makes to one DiT parameter at strength 1 (None if none)."""
    terms = lora_plan.targets.get(param)
    if not terms:
        return None
    total = None
    for part, t in terms:
        k = t.keys
        if part is Part.UP:
            down, up = tensors[k[Part.DOWN]].float(), tensors[k[Part.UP]].float()
            rank = down.shape[0]
            scale = float(tensors[k[Part.ALPHA]].float().reshape(-1)[0]) / rank if Part.ALPHA in k else 1.0
            d = (up @ down) * scale
        else:
            d = tensors[k[part]].float()
        total = d if total is None else total + d
    return total


@dataclass(frozen=True)
class LoraSource:
    """One LoRA to apply: its file and strength."""

    path: Path
    strength: float


class LoraDeltas:
    """The LoRAs of a run, checked against the DiT's parameter shapes and held in memory (LoRA
    files are small); :meth:`delta` computes one parameter's summed change on demand, so merging
    never holds more than one parameter's delta."""

    def __init__(self, loras: Iterable[LoraSource], shapes: Mapping[str, Sequence[int]],
                 allow_partial: bool = False):
        from safetensors.torch import load_file
        self._loaded: list[tuple[LoraPlan, dict, float]] = []
        self.records: list[dict] = []
        names: dict[str, None] = {}
        for src in loras:
            p = plan(file_shapes(src.path), shapes)
            if p.refused(allow_partial):
                raise ValueError(
                    f"LoRA {src.path.name} does not fit this DiT ({'; '.join(p.problems()) or 'no keys'}): "
                    f"{p.likely_cause()}"
                )
            self._loaded.append((p, load_file(str(src.path), device="cpu"), src.strength))
            names.update(dict.fromkeys(p.targets))
            self.records.append({"path": str(src.path), "strength": src.strength, "format": p.format,
                                 "matched_modules": len(p.matched_modules), "unmatched_modules": len(p.unmatched),
                                 "parameters_changed": len(p.targets)})
        self.names = tuple(names)

    def delta(self, name: str, device=None):
        """Sum over the LoRAs, in order, of ``strength * delta`` for parameter ``name`` (fp32)."""
        total = None
        for p, tensors, strength in self._loaded:
            if name in p.targets:
                d = delta_for(name, p, tensors)
                d = (d.to(device) if device is not None else d) * strength
                total = d if total is None else total + d
        return total


def merger(refs: Iterable, allow_partial: bool = False) -> Callable[[Any], list[dict]]:
    """How a run's LoRAs (``refs``: the spec's :class:`~wan_s2v_runner.shared.spec.LoraRef` items,
    a path and a strength each) merge into a loaded DiT: ``model -> records`` (:func:`merge`). The
    rank gives it to ``patches.lora_merge``, which calls it where upstream configures the DiT (the
    patch reads no LoRA file itself: patches do not import loading)."""
    sources = [LoraSource(Path(ref.path), ref.strength) for ref in refs]
    return lambda model: merge(model, sources, allow_partial=allow_partial)


def merge(model, loras: Iterable[LoraSource], allow_partial: bool = False) -> list[dict]:
    """Merge LoRAs into ``model``'s parameters in place: for every parameter, the sum over LoRAs
    of ``strength * delta`` in fp32 (on the parameter's device), added to the fp32 weight, rounded
    once to the parameter's dtype. Raises ValueError on keys that do not map (unless
    ``allow_partial``) or on a shape mismatch. Returns one record per LoRA."""
    import torch

    params = dict(model.named_parameters())
    deltas = LoraDeltas(loras, {n: tuple(p.shape) for n, p in params.items()}, allow_partial)
    with torch.no_grad():
        for name in deltas.names:
            w = params[name]
            w.copy_((w.float() + deltas.delta(name, w.device)).to(w.dtype))
    return deltas.records


def describe(refs: Sequence, ckpt_dir: Optional[Path], dit_file: Optional[Path] = None) -> list[dict]:
    """For run.json: each LoRA's path, sha256, format, strength and matched-module count (from
    the headers, by the same :func:`plan` the merge uses)."""
    from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError
    from wan_s2v_runner.loading.dit_file import dit_shapes
    from wan_s2v_runner.shared.media import sha256_file

    try:
        dit = dit_shapes(ckpt_dir, dit_file) if ckpt_dir else None
    except (CheckpointFileError, OSError):
        dit = None
    out = []
    for ref in refs:
        rec: dict = {"path": str(ref.path), "strength": ref.strength, "sha256": None, "format": None,
                     "matched_modules": None}
        try:
            rec["sha256"] = sha256_file(ref.path)
            p = plan(file_shapes(ref.path), dit) if dit is not None else None
        except (CheckpointFileError, OSError):
            p = None
        if p is not None:
            rec.update(format=p.format, matched_modules=len(p.matched_modules),
                       unmatched_modules=len(p.unmatched))
        out.append(rec)
    return out
