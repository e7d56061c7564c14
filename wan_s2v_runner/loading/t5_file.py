"""What a single T5 file holds (``--t5-file``), from its safetensors header alone, and how the
T5 encoder is read from it.

The checkpoint directory's T5 is ``models_t5_umt5-xxl-enc-bf16.pth`` (11.4 GB, wan's names).
ComfyUI users already hold the same UMT5-XXL encoder as one safetensors file
(``models/text_encoders/umt5_xxl_fp16.safetensors``, ``..._bf16``, or
``umt5_xxl_fp8_e4m3fn_scaled.safetensors``, 6.7 GB). :func:`inspect` recognises one:

* **names** (:data:`NAMINGS`): Hugging Face's UMT5 names, which ComfyUI's files use
  (``comfy/text_encoders/t5.py``: ``shared.weight``, ``encoder.block.N.layer.0.SelfAttention.q``,
  ``...relative_attention_bias`` in every block, ``encoder.block.N.layer.1.DenseReluDense.wi_0``,
  ``encoder.final_layer_norm``), mapped to those of wan's ``T5Encoder``
  (``wan/modules/t5.py``), or wan's own names (the ``.pth``'s tensors saved as safetensors). The
  feed-forward: wan computes ``fc2(fc1(x) * gelu(gate.0(x)))``, Hugging Face
  ``wo(gelu(wi_0(x)) * wi_1(x))``, so ``wi_0`` is ``gate.0``, ``wi_1`` is ``fc1``, ``wo`` is ``fc2``.
  A tied copy of the embedding (``encoder.embed_tokens.weight`` beside ``shared.weight``), a
  decoder, ``lm_head`` and ComfyUI's tokenizer record (``spiece_model``) are not read: the
  tokenizer is CKPT_DIR's.
* **storage**: what ``--dit-file`` reads (:mod:`wan_s2v_runner.loading.dit_file`, whose helpers
  do it): full precision, fp8 cast without a scale, ComfyUI's scaled fp8 (``scaled_fp8`` marker,
  float32 ``scale_weight`` per Linear) and its newer ``weight_scale``/``comfy_quant`` form. A
  scaled weight's value is ``weight.to(float32) * scale``, then the T5's dtype.
* **structure**: every tensor of a UMT5 encoder (per-block relative position embeddings, gated
  feed-forward), with shapes consistent with one set of dims (:func:`expected_shapes`);
  :func:`config_mismatch` compares those dims with the checkpoint's T5 (:func:`reference_dims`).

Anything else is refused with :class:`T5FileError` (a :class:`DitFileError`: the cause and the
fix, one line each). Reading the values is :class:`~wan_s2v_runner.loading.ckpt_read.DitFileSource`'s,
given this module's layout (:func:`open_t5_file`); the model is built on meta from the file's
dims (:func:`empty_t5`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.loading.ckpt_tables import read_pth_shapes, read_safetensors_header
from wan_s2v_runner.loading.dit_file import (
    DitFileError,
    DitFileFormat,
    DitFileLayout,
    bytes_reader,
    double_scaled,
    layer_formats,
    quant_role,
    settle_storage,
)
from wan_s2v_runner.shared.ckpt_layout import T5_FILE, TINY_INFO_FILE

FLAG = "--t5-file"
FIX_FILE = ("pass the UMT5-XXL text encoder (ComfyUI's models/text_encoders/umt5_xxl_fp16.safetensors or "
            "umt5_xxl_fp8_e4m3fn_scaled.safetensors), or drop --t5-file to use CKPT_DIR's " + T5_FILE)
HF, WAN = "Hugging Face/ComfyUI", "Wan"
#: the namings a T5 file may use
NAMINGS = (HF, WAN)
#: tensors a T5 file may hold that the encoder does not read (ComfyUI's tokenizer record)
IGNORED_KEYS = ("spiece_model",)
#: a full encoder-decoder's parts the encoder does not read
IGNORED_PREFIXES = ("decoder.", "lm_head.")
#: Hugging Face's tied copy of ``shared.weight``
TIED_EMBEDDING = "encoder.embed_tokens"
#: the dims :func:`t5_dims` finds, compared with the checkpoint's
DIM_KEYS = ("vocab_size", "dim", "dim_attn", "dim_ffn", "num_heads", "num_layers", "num_buckets")

#: Hugging Face module (in ``encoder.block.N.``) -> wan's (in ``blocks.N.``)
_HF_BLOCK = {
    "layer.0.layer_norm": "norm1",
    "layer.0.SelfAttention.q": "attn.q",
    "layer.0.SelfAttention.k": "attn.k",
    "layer.0.SelfAttention.v": "attn.v",
    "layer.0.SelfAttention.o": "attn.o",
    "layer.0.SelfAttention.relative_attention_bias": "pos_embedding.embedding",
    "layer.1.layer_norm": "norm2",
    "layer.1.DenseReluDense.wi_0": "ffn.gate.0",  # through the GELU, as wan's gate
    "layer.1.DenseReluDense.wi_1": "ffn.fc1",
    "layer.1.DenseReluDense.wo": "ffn.fc2",
}
_HF_TOP = {"shared": "token_embedding", TIED_EMBEDDING: "token_embedding", "encoder.final_layer_norm": "norm"}
_WAN_TOP = {v: k for k, v in _HF_TOP.items() if k != TIED_EMBEDDING}
_WAN_BLOCK = {v: k for k, v in _HF_BLOCK.items()}
_HF_BLOCK_RE = re.compile(r"encoder\.block\.(\d+)\.(.+)")
_WAN_BLOCK_RE = re.compile(r"blocks\.(\d+)\.(.+)")


class T5FileError(DitFileError):
    """A single T5 file we cannot use: :attr:`cause` and :attr:`fix`, one line each."""

    def __init__(self, cause: str, fix: str = FIX_FILE):
        super().__init__(cause, fix)


def hf_module(module: str) -> Optional[str]:
    """Wan's name of a Hugging Face UMT5 encoder module (None: not one)."""
    if module in _HF_TOP:
        return _HF_TOP[module]
    m = _HF_BLOCK_RE.fullmatch(module)
    if m and m.group(2) in _HF_BLOCK:
        return f"blocks.{m.group(1)}.{_HF_BLOCK[m.group(2)]}"
    return None


def to_hf(name: str) -> str:
    """The Hugging Face key of wan's tensor ``name`` (for messages); ``name`` when it has none."""
    module, _, leaf = name.rpartition(".")
    if module in _WAN_TOP:
        return f"{_WAN_TOP[module]}.{leaf}"
    m = _WAN_BLOCK_RE.fullmatch(module)
    if m and m.group(2) in _WAN_BLOCK:
        return f"encoder.block.{m.group(1)}.{_WAN_BLOCK[m.group(2)]}.{leaf}"
    return name


@dataclass
class T5FileLayout(DitFileLayout):
    """A single T5 file's weights under wan's names (scales, markers and unread tensors set apart)."""

    naming: str = WAN
    ignored: list[str] = field(default_factory=list)  # the file's keys the encoder does not read

    def file_key(self, name: str) -> str:
        """The file's key of wan's tensor ``name`` (in the file's naming, present or not)."""
        return self.keys.get(name) or (to_hf(name) if self.naming == HF else name)

    @property
    def dims(self) -> dict[str, Any]:
        return t5_dims(self.shapes)

    def describe(self) -> str:
        return (f"{self.path.name}: {self.format.value}, {self.naming} names, {self.storage()}; "
                f"UMT5 encoder: {describe_dims(self.dims)}"
                + (f"; not read: {', '.join(self.ignored[:3])}{' ...' if len(self.ignored) > 3 else ''}"
                   if self.ignored else ""))


def describe_dims(d: dict) -> str:
    return (f"dim {d['dim']}, {_n(d['num_layers'], 'layer')}, {d['num_heads']} heads, attention {d['dim_attn']}, "
            f"ffn {d['dim_ffn']}, vocab {d['vocab_size']}")


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _naming(keys, path: Path) -> str:
    """Which naming the file's tensor ``keys`` use (refusing what is not a T5 encoder's)."""
    if any(k.startswith(("head.modulation", "patch_embedding.", "model.diffusion_model.")) for k in keys):
        raise T5FileError(f"{path.name} is a Wan DiT, not the T5 text encoder",
                          "pass it to --dit-file, and the UMT5-XXL encoder to --t5-file")
    hf = any(k.startswith("encoder.") or k.split(".")[0] == "shared" for k in keys)
    wan = any(k.startswith(("blocks.", "token_embedding.")) for k in keys)
    if hf and wan:
        raise T5FileError(f"{path.name}: its names mix Hugging Face's (encoder.block.N...) and wan's (blocks.N...)",
                          "save the encoder with one naming")
    if not (hf or wan):
        sample = ", ".join(sorted(keys)[:3]) or "no tensors"
        raise T5FileError(f"{path.name} is not a UMT5-XXL encoder: it lacks the encoder's tensors "
                          f"(shared.weight, encoder.block.N... or wan's token_embedding.weight, blocks.N...; "
                          f"it holds {sample})")
    return HF if hf else WAN


def inspect(path) -> T5FileLayout:
    """The single T5 file at ``path``: its names (mapped to wan's), storage format, scales and
    structure (header, plus the few bytes of any ``comfy_quant`` record). Raises
    :class:`T5FileError`/:class:`DitFileError` (cause and fix) or
    :class:`~wan_s2v_runner.loading.ckpt_tables.CheckpointFileError` (not a complete safetensors file)."""
    path = Path(path)
    if not path.is_file():
        raise T5FileError(f"{FLAG} {path} does not exist (or is not a file)")
    if path.suffix not in (".safetensors", ".sft"):
        raise T5FileError(f"{FLAG} {path.name} is not a .safetensors file (GGUF is not read; a .pth T5 is read "
                          f"from CKPT_DIR as {T5_FILE})")
    info = read_safetensors_header(path)
    naming = _naming(info.tensors, path)

    def module_name(module: str) -> Optional[str]:
        return hf_module(module) if naming == HF else module

    formats = layer_formats(info, bytes_reader(path, info), module_name=lambda m: module_name(m) or m)
    out = T5FileLayout(path, info, DitFileFormat.FULL, "", naming=naming)
    marker, unknown = False, []
    scale_keys: dict[str, tuple[str, str]] = {}  # wan weight name -> (scale key, which form)
    shared = info.tensors.get("shared.weight") if naming == HF else None
    for key, (dtype, shape) in info.tensors.items():
        role = quant_role(key)
        if role == "marker":
            marker = True
            continue
        if role == "unused":
            continue
        if role == "double":
            raise double_scaled(path, key)
        module, _, leaf = key.rpartition(".")
        if key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES):
            out.ignored.append(key)
            continue
        if shared is not None and module == TIED_EMBEDDING:  # Hugging Face's copy of shared.weight
            if role is None and tuple(shape) != tuple(shared[1]):
                raise T5FileError(f"{path.name}: {key} {list(shape)} differs from shared.weight {list(shared[1])} "
                                  "(Hugging Face ties the two)")
            out.ignored.append(key)
            continue
        name = module_name(module)
        if name is None or (role is None and leaf != "weight"):
            unknown.append(key)
            continue
        if role == "scale":
            scale_keys[f"{name}.weight"] = (key, leaf)
            continue
        name = f"{name}.{leaf}"
        if name in out.keys:
            raise T5FileError(f"{path.name}: {name} appears twice ({out.keys[name]!r} and {key!r})",
                              "keep one copy of each tensor")
        out.keys[name], out.dtypes[name], out.shapes[name] = key, dtype, tuple(shape)
    if unknown:
        raise T5FileError(_unknown_cause(path, unknown))
    check_structure(out)
    settle_storage(out, scale_keys, formats, marker)
    return out


def _unknown_cause(path: Path, unknown: list[str]) -> str:
    some = ", ".join(unknown[:3]) + (" ..." if len(unknown) > 3 else "")
    if any(".DenseReluDense.wi." in k for k in unknown):
        return (f"{path.name} is not a UMT5-XXL encoder: its feed-forward is ungated (DenseReluDense.wi), "
                "an original T5's")
    return f"{path.name} is not a UMT5-XXL encoder: it holds {_n(len(unknown), 'tensor')} no UMT5 encoder has ({some})"


def t5_dims(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The encoder's dims from its (wan-named) tensor shapes, by the rules the engine's sizes are
    read with (``patches.checkpoint_dims``)."""
    from patches.checkpoint_dims import t5_dims_from_shapes
    return t5_dims_from_shapes(shapes)


def expected_shapes(d: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of wan's ``T5Encoder`` (``shared_pos=False``, as UMT5) of dims ``d``, and its shape."""
    dim, attn, ffn = d["dim"], d["dim_attn"], d["dim_ffn"]
    out = {"token_embedding.weight": (d["vocab_size"], dim), "norm.weight": (dim,)}
    for i in range(d["num_layers"]):
        b = f"blocks.{i}."
        out.update({b + "norm1.weight": (dim,), b + "attn.q.weight": (attn, dim), b + "attn.k.weight": (attn, dim),
                    b + "attn.v.weight": (attn, dim), b + "attn.o.weight": (dim, attn), b + "norm2.weight": (dim,),
                    b + "ffn.gate.0.weight": (ffn, dim), b + "ffn.fc1.weight": (ffn, dim),
                    b + "ffn.fc2.weight": (dim, ffn),
                    b + "pos_embedding.embedding.weight": (d["num_buckets"], d["num_heads"])})
    return out


def check_structure(out: T5FileLayout) -> None:
    """Every tensor of a UMT5 encoder, no other, shapes consistent with one set of dims."""
    path, shapes = out.path, out.shapes
    layers = sorted({int(m.group(1)) for k in shapes if (m := _WAN_BLOCK_RE.match(k))})
    pos = "blocks.{}.pos_embedding.embedding.weight"
    if len(layers) > 1 and pos.format(0) in shapes and not any(pos.format(i) in shapes for i in layers[1:]):
        raise T5FileError(f"{path.name} is not a UMT5-XXL encoder: only block 0 has a relative_attention_bias "
                          "(a T5 v1.1 encoder, e.g. Flux's t5xxl; UMT5 has one per block)")
    if "pos_embedding.embedding.weight" in shapes:
        raise T5FileError(f"{path.name} is not a UMT5-XXL encoder: one position embedding shared by all blocks "
                          "(UMT5 has one per block)")
    names = set(expected_shapes(dict.fromkeys(DIM_KEYS, 1) | {"num_layers": layers[-1] + 1 if layers else 0}))
    missing = sorted(names - set(shapes), key=_order)
    if missing:
        some = ", ".join(out.file_key(n) for n in missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise T5FileError(f"{path.name} is not a UMT5-XXL encoder: it lacks {_n(len(missing), 'tensor')} of one "
                          f"({some})")
    extra = sorted(set(shapes) - names, key=_order)
    if extra:
        raise T5FileError(f"{path.name} is not a UMT5-XXL encoder: it holds {_n(len(extra), 'tensor')} no UMT5 "
                          f"encoder has ({', '.join(out.file_key(n) for n in extra[:3])})")
    try:
        d = t5_dims(shapes)
    except ValueError as e:
        raise T5FileError(f"{path.name} is not a UMT5-XXL encoder: {e}") from None
    want = expected_shapes(d)
    for n in sorted(want, key=_order):
        if tuple(shapes[n]) != want[n]:
            raise T5FileError(f"{path.name}: {out.file_key(n)} has shape {list(shapes[n])}, the encoder's other "
                              f"tensors ({describe_dims(d)}) make it {list(want[n])}: a damaged file or another "
                              "model's")


def _order(name: str):
    m = _WAN_BLOCK_RE.match(name)
    return (int(m.group(1)) if m else -1, name)


def reference_dims(ckpt_dir) -> tuple[Optional[dict], str]:
    """The checkpoint's T5 dims and where they come from: its ``.pth`` (shapes only), or, without
    one, a test checkpoint's record (``tiny_checkpoint.json``), or the engine's umt5-xxl (the
    Wan2.2-S2V-14B T5). (None, why) when the ``.pth`` cannot be read."""
    from patches.checkpoint_dims import UPSTREAM_T5, t5_dims_from_shapes
    ckpt = Path(ckpt_dir) if ckpt_dir is not None else None
    if ckpt is not None and (ckpt / T5_FILE).is_file():
        try:
            shapes = read_pth_shapes(ckpt / T5_FILE)
            return t5_dims_from_shapes({k: s for k, (s, _) in shapes.items()}, T5_FILE), f"CKPT_DIR's {T5_FILE}"
        except (OSError, ValueError) as e:
            return None, f"{T5_FILE} unreadable ({e})"
    if ckpt is not None and (ckpt / TINY_INFO_FILE).is_file():
        try:
            rec = json.loads((ckpt / TINY_INFO_FILE).read_text(encoding="utf-8"))["t5"]
            return {k: int(rec[k]) for k in DIM_KEYS}, f"CKPT_DIR's {TINY_INFO_FILE}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return dict(UPSTREAM_T5), "the engine's umt5-xxl (Wan2.2-S2V-14B)"


def config_mismatch(dims: dict, ref: Optional[dict], where: str) -> Optional[str]:
    """Why an encoder of ``dims`` is not the checkpoint's T5 (``ref``, from ``where``), or None."""
    if not ref:
        return None
    for key in DIM_KEYS:
        if key in ref and int(ref[key]) != int(dims[key]):
            return (f"it has {key} {dims[key]}, {where} {ref[key]}: another model's text encoder "
                    f"({describe_dims(dims)})")
    return None


def open_t5_file(path, counter=None):
    """The T5 file's weights under wan's names, read as
    :class:`~wan_s2v_runner.loading.ckpt_read.DitFileSource` reads a ``--dit-file`` (a scaled fp8
    weight as ``weight.to(float32) * scale``, then the destination's dtype)."""
    from wan_s2v_runner.loading.ckpt_read import DitFileSource
    layout = inspect(path)
    return DitFileSource(layout.path, counter, layout=layout)


def empty_t5(wan, dims: dict, dtype):
    """Wan's UMT5 encoder (``umt5_xxl(encoder_only=True)``, the module ``T5EncoderModel`` builds)
    of ``dims``, parameters on meta in ``dtype``."""
    return wan.modules.t5.umt5_xxl(
        encoder_only=True, return_tokenizer=False, dtype=dtype, device="meta", vocab_size=dims["vocab_size"],
        dim=dims["dim"], dim_attn=dims["dim_attn"], dim_ffn=dims["dim_ffn"], num_heads=dims["num_heads"],
        encoder_layers=dims["num_layers"], num_buckets=dims["num_buckets"], shared_pos=False,
    ).eval().requires_grad_(False)
