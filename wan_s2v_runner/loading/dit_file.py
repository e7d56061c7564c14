"""What a single DiT file holds (``--dit-file``), from its safetensors header alone (no torch).

Users already hold the S2V DiT as one ComfyUI-style file (``wan2.2_s2v_14B_bf16.safetensors``,
``..._fp8_scaled.safetensors``, Kijai's ``*_fp8_e4m3fn_scaled_KJ``). :func:`inspect` recognises one:

* **names**: the native Wan names (``blocks.0.self_attn.q.weight``), bare or under
  ``model.diffusion_model.`` (ComfyUI's checkpoint form) or ``diffusion_model.``; both ComfyUI
  and Kijai's loader strip the prefix, and so do we.
* **storage** (:class:`DitFileFormat`): full precision (bf16, fp16, fp32); fp8 cast without a
  scale (value = ``weight.to(dtype)``); ComfyUI's older "scaled fp8" (a top-level ``scaled_fp8``
  marker, per Linear an fp8 ``weight`` and a float32 ``scale_weight``, sometimes ``scale_input``);
  its newer form (``weight_scale``, ``input_scale``, and the format per layer in a uint8
  ``comfy_quant`` tensor holding JSON, or in the header's ``_quantization_metadata``). A scaled
  weight's value is ``weight.to(float32) * scale`` (the scale is one number, or one per output
  row). Activation scales (``scale_input``/``input_scale``) are for fp8 matmuls; a full-precision
  forward does not use them.
* **architecture** (:func:`architecture`): a Wan DiT has ``head.modulation``; S2V has the audio
  modules (``casual_audio_encoder``, ``audio_injector``); I2V has ``img_emb``; the dims come from
  the shapes. :func:`config_mismatch` compares them with the checkpoint's ``config.json``.

Anything else (int8 blocks, nvfp4, double scales) is refused with :class:`DitFileError`, whose
message is the cause and the fix. Reading the values is
:class:`wan_s2v_runner.loading.ckpt_read.DitFileSource`'s. The storage rules (:func:`quant_role`,
:func:`layer_formats`, :func:`settle_storage`) read a ``--t5-file`` too
(:mod:`wan_s2v_runner.loading.t5_file`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

from wan_s2v_runner.loading.ckpt_tables import CheckpointFileError, SafetensorsInfo, read_safetensors_header
from wan_s2v_runner.loading.ckpt_tables import dit_shapes as dir_dit_shapes

#: name prefixes a single-file DiT may carry (stripped; the first that matches)
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
#: what a full ComfyUI checkpoint holds besides the DiT (its VAE, its text encoders)
OTHER_MODELS = ("first_stage_model.", "cond_stage_model.", "text_encoders.", "vae.", "conditioner.")
#: top-level marker of ComfyUI's older scaled-fp8 files
SCALED_FP8_MARKER = "scaled_fp8"
#: per-Linear tensors beside ``weight``: the weight scale of each form, and what a
#: full-precision forward does not read (activation scales, the per-layer format record)
OLD_SCALE, NEW_SCALE = "scale_weight", "weight_scale"
UNUSED_SUFFIXES = ("scale_input", "input_scale", "comfy_quant")
#: per-layer quantization formats we read, and the storage dtype each means
QUANT_FORMATS = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FULL_DTYPES = ("F32", "BF16", "F16")
FIX_FP8 = "use a bf16 file, or one scaled to float8_e4m3fn (scale_weight or weight_scale)"
FIX_FILE = ("pass the Wan2.2 S2V-14B DiT (e.g. ComfyUI's wan2.2_s2v_14B_bf16.safetensors or "
            "wan2.2_s2v_14B_fp8_scaled.safetensors), or drop --dit-file to use CKPT_DIR's DiT")


class DitFileFormat(str, Enum):
    """How a single DiT file stores its weights."""

    FULL = "full precision"
    FP8_CAST = "fp8, no scales"
    SCALED_FP8 = "ComfyUI scaled fp8 (scale_weight)"
    COMFY_QUANT = "ComfyUI quantized fp8 (weight_scale)"

    @property
    def fp8(self) -> bool:
        return self is not DitFileFormat.FULL


class DitFileError(CheckpointFileError):
    """A single DiT file we cannot use: :attr:`cause` and :attr:`fix`, one line each."""

    def __init__(self, cause: str, fix: str = FIX_FILE):
        super().__init__(f"{cause}. Fix: {fix}")
        self.cause, self.fix = cause, fix


class WanKind(str, Enum):
    """Which Wan DiT a file holds (from its tensors' names: :func:`architecture`)."""

    S2V = "S2V"
    I2V = "I2V"
    T2V = "T2V"
    NONE = ""  # not a Wan DiT

    def __bool__(self) -> bool:
        return self is not WanKind.NONE


@dataclass(frozen=True)
class DitArchitecture:
    """What model a DiT file is, from its tensor shapes."""

    kind: "WanKind"  # S2V, I2V, T2V (a Wan DiT), or NONE (not a Wan DiT)
    dim: int = 0
    in_dim: int = 0
    ffn_dim: int = 0
    num_layers: int = 0
    audio_layers: int = 0  # audio injection layers (S2V)

    def describe(self) -> str:
        if not self.kind:
            return "not a Wan DiT"
        audio = f", {self.audio_layers} audio layers" if self.kind is WanKind.S2V else ""
        return (f"Wan {self.kind.value} DiT: dim {self.dim}, in_dim {self.in_dim}, ffn {self.ffn_dim}, "
                f"{self.num_layers} layers{audio}")


@dataclass
class DitFileLayout:
    """A single DiT file's weights under their Wan names (scales and markers set apart)."""

    path: Path
    info: SafetensorsInfo
    format: DitFileFormat
    prefix: str  # the prefix stripped ("" when bare)
    keys: dict[str, str] = field(default_factory=dict)  # Wan name -> the file's key
    dtypes: dict[str, str] = field(default_factory=dict)  # Wan name -> storage dtype (safetensors name)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # Wan name -> shape
    scales: dict[str, str] = field(default_factory=dict)  # Wan name of a scaled weight -> its scale's key

    @property
    def architecture(self) -> DitArchitecture:
        return architecture(self.shapes)

    def storage(self) -> str:
        """``N tensors (n1 dtype1, ...), P params, S GB``: what the file stores (every single-file layout)."""
        counts: dict[str, int] = {}
        for d in self.dtypes.values():
            counts[d] = counts.get(d, 0) + 1
        stored = ", ".join(f"{n} {d}" for d, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        params = sum(math.prod(s) for s in self.shapes.values())
        return f"{len(self.shapes)} tensors ({stored}), {params:,} params, {self.info.file_size / 1e9:.2f} GB"

    def describe(self) -> str:
        names = f"under {self.prefix!r}" if self.prefix else "bare"
        return f"{self.path.name}: {self.format.value}, names {names}, {self.storage()}"


def _strip(key: str) -> tuple[str, str]:
    for p in PREFIXES:
        if key.startswith(p):
            return key[len(p):], p
    return key, ""


def bytes_reader(path: Path, info: SafetensorsInfo):
    """``read_bytes(key)``: the raw bytes of one (small) tensor of the file ``info`` describes."""
    def read_bytes(key: str) -> bytes:
        with open(path, "rb") as f:
            f.seek(info.starts[key])
            return f.read(math.prod(info.tensors[key][1]))
    return read_bytes


def layer_formats(info: SafetensorsInfo, read_bytes, module_name=None) -> dict[str, str]:
    """Layer (the model's name of the module: ``module_name(file's module key)``, by default the
    key with its DiT prefix stripped) -> its declared quantization format, from the header's
    ``_quantization_metadata`` and the ``comfy_quant`` tensors (read: a few bytes each)."""
    module_name = module_name or (lambda k: _strip(k)[0])
    out: dict[str, str] = {}
    raw = info.metadata.get("_quantization_metadata")
    if raw:
        try:
            layers = json.loads(raw).get("layers", {})
            out.update({module_name(k): str(v.get("format")) for k, v in layers.items()})
        except (ValueError, AttributeError, TypeError):
            raise DitFileError(f"{info.path.name}: its _quantization_metadata is not the JSON ComfyUI writes "
                               "(format_version, layers); fp8 format not recognised", FIX_FP8) from None
    for key in info.tensors:
        if key.endswith(".comfy_quant"):
            try:
                fmt = json.loads(read_bytes(key).decode("utf-8")).get("format")
            except (ValueError, UnicodeDecodeError, AttributeError):
                raise DitFileError(f"{info.path.name}: {key} is not the JSON ComfyUI writes; fp8 format not "
                                   "recognised", FIX_FP8) from None
            out[module_name(key.removesuffix(".comfy_quant"))] = str(fmt)
    return out


def quant_role(name: str) -> Optional[str]:
    """What a tensor named ``name`` is beside the weights: ``"marker"`` (the top-level
    ``scaled_fp8``), ``"unused"`` (an activation scale, a ``comfy_quant`` record), ``"scale"`` (a
    weight's ``scale_weight``/``weight_scale``), ``"double"`` (a double-scaled format's), or None
    (a weight). Raises nothing: the caller names the refusal."""
    if name == SCALED_FP8_MARKER:
        return "marker"
    leaf = name.rpartition(".")[2]
    if leaf in UNUSED_SUFFIXES:
        return "unused"
    if leaf in (OLD_SCALE, NEW_SCALE):
        return "scale"
    if leaf in ("weight_scale_2", "pre_quant_scale"):
        return "double"
    return None


def double_scaled(path: Path, key: str) -> DitFileError:
    return DitFileError(f"{path.name}: {key} belongs to a double-scaled format (nvfp4/mxfp8-style); fp8 "
                        "format not recognised", FIX_FP8)


def inspect(path) -> DitFileLayout:
    """The single DiT file at ``path``: its names, storage format and scales (header, plus the
    few bytes of any ``comfy_quant`` record). Raises :class:`DitFileError` (cause and fix) or
    :class:`CheckpointFileError` (not a complete safetensors file)."""
    path = Path(path)
    if not path.is_file():
        raise DitFileError(f"--dit-file {path} does not exist (or is not a file)")
    if path.suffix not in (".safetensors", ".sft"):
        raise DitFileError(f"--dit-file {path.name} is not a .safetensors file (GGUF and .pth DiTs are not read)")
    info = read_safetensors_header(path)

    others = sorted({k.split(".", 1)[0] for k in info.tensors if k.startswith(OTHER_MODELS)})
    if others:
        raise DitFileError(f"{path.name} holds more than the DiT ({', '.join(others)}: a full ComfyUI checkpoint "
                           "with its VAE or text encoder)", "pass the DiT-only file (ComfyUI's "
                           "models/diffusion_models/wan2.2_s2v_14B_*.safetensors)")
    formats = layer_formats(info, bytes_reader(path, info))
    out = DitFileLayout(path, info, DitFileFormat.FULL, "")
    prefixes: set[str] = set()
    marker = False
    scale_keys: dict[str, tuple[str, str]] = {}  # Wan weight name -> (scale key, which form)
    for key, (dtype, shape) in info.tensors.items():
        name, prefix = _strip(key)
        role = quant_role(name)
        if role == "marker":
            marker = True
            continue
        if role == "unused":
            continue
        if role == "scale":
            module, _, leaf = name.rpartition(".")
            scale_keys[f"{module}.weight"] = (key, leaf)
            continue
        if role == "double":
            raise double_scaled(path, key)
        if name in out.keys:
            raise DitFileError(f"{path.name}: {name} appears twice ({out.keys[name]!r} and {key!r})",
                               "keep one copy of each tensor (bare names or model.diffusion_model., not both)")
        prefixes.add(prefix)
        out.keys[name], out.dtypes[name], out.shapes[name] = key, dtype, tuple(shape)
    if len(prefixes) > 1:
        raise DitFileError(f"{path.name}: its names mix the prefixes {sorted(prefixes)}",
                           "save the DiT with one naming: bare Wan names, or all under model.diffusion_model.")
    out.prefix = prefixes.pop() if prefixes else ""
    settle_storage(out, scale_keys, formats, marker)
    return out


def settle_storage(out: DitFileLayout, scale_keys: dict[str, tuple[str, str]], formats: dict[str, str],
                   marker: bool) -> None:
    """Check and record how ``out``'s weights (``keys``/``dtypes``/``shapes`` filled, under the
    model's names) are stored: ``scale_keys`` (weight name -> (its scale's key, ``scale_weight`` or
    ``weight_scale``)), ``formats`` (:func:`layer_formats`), ``marker`` (a ``scaled_fp8`` tensor
    seen). Sets ``out.scales`` and ``out.format``; raises :class:`DitFileError` (fix: :data:`FIX_FP8`)."""
    path, info = out.path, out.info
    forms = {form for _, form in scale_keys.values()}
    if len(forms) > 1:
        raise DitFileError(f"{path.name}: mixes scale_weight and weight_scale; fp8 format not recognised", FIX_FP8)
    for wname, (skey, _form) in scale_keys.items():
        if wname not in out.keys:
            raise DitFileError(f"{path.name}: scale {skey!r} has no weight beside it; fp8 format not recognised",
                               FIX_FP8)
        sshape = tuple(info.tensors[skey][1])
        rows = out.shapes[wname][0] if out.shapes[wname] else 1
        # one number ([], [1], [1, 1]) or one per output row ([rows], [rows, 1]); [1, in] is per column
        per_row = sshape in ((rows,), (rows, 1))
        if info.tensors[skey][0] not in FULL_DTYPES or not (math.prod(sshape) == 1 or per_row) or len(sshape) > 2:
            raise DitFileError(f"{path.name}: scale {skey!r} is {info.tensors[skey][0]} {list(sshape)}, not one "
                               f"float per tensor or per output row ({rows}); fp8 format not recognised", FIX_FP8)
        out.scales[wname] = skey
    for module, fmt in formats.items():
        if fmt not in QUANT_FORMATS:
            raise DitFileError(f"{path.name}: layer {module} is quantized as {fmt!r}; fp8 format not recognised "
                               f"(we read {', '.join(QUANT_FORMATS)})", FIX_FP8)
        wname = f"{module}.weight"
        if wname in out.dtypes and out.dtypes[wname] == "U8":  # ComfyUI may store fp8 in a uint8 container
            out.dtypes[wname] = QUANT_FORMATS[fmt]
    for name, dtype in out.dtypes.items():
        if dtype in FP8_DTYPES or dtype in FULL_DTYPES:
            continue
        raise DitFileError(f"{path.name}: {out.keys[name]} is stored as {dtype}, not a float format we read "
                           "(bf16, fp16, fp32, float8); fp8 format not recognised", FIX_FP8)
    for wname in out.scales:
        if out.dtypes[wname] not in FP8_DTYPES:
            raise DitFileError(f"{path.name}: {out.keys[wname]} has a scale but is stored as {out.dtypes[wname]}; "
                               "fp8 format not recognised", FIX_FP8)
    has_fp8 = any(d in FP8_DTYPES for d in out.dtypes.values())
    if scale_keys:
        out.format = DitFileFormat.SCALED_FP8 if forms == {OLD_SCALE} else DitFileFormat.COMFY_QUANT
    elif has_fp8:
        out.format = DitFileFormat.FP8_CAST
    if marker and not scale_keys:
        raise DitFileError(f"{path.name}: has the scaled_fp8 marker but no scale_weight tensors; fp8 format not "
                           "recognised", FIX_FP8)


def dit_shapes(ckpt_dir, dit_file=None) -> dict[str, tuple[int, ...]]:
    """The DiT's tensor name -> shape: ``dit_file``'s under the model's names when given, else the
    checkpoint directory's (headers only; raises CheckpointFileError/OSError)."""
    if dit_file is not None:
        return dict(inspect(dit_file).shapes)
    return dir_dit_shapes(Path(ckpt_dir))


def architecture(shapes: dict[str, tuple[int, ...]]) -> DitArchitecture:
    """Which Wan DiT these (Wan-named) tensor shapes are, and its dims."""
    if "head.modulation" not in shapes or "patch_embedding.weight" not in shapes:
        return DitArchitecture(WanKind.NONE)
    pe = shapes["patch_embedding.weight"]  # [dim, in_dim, 1, 2, 2]
    layers = {k.split(".")[1] for k in shapes if k.startswith("blocks.")}
    ffn = shapes.get("blocks.0.ffn.0.weight", (0,))[0]
    audio = {k.split(".")[2] for k in shapes if k.startswith("audio_injector.injector.")}
    if any(k.startswith("casual_audio_encoder.") for k in shapes) or audio:
        kind = WanKind.S2V
    elif any(k.startswith("img_emb.") for k in shapes):
        kind = WanKind.I2V
    else:
        kind = WanKind.T2V
    return DitArchitecture(kind, pe[0], pe[1] if len(pe) > 1 else 0, ffn, len(layers), len(audio))


def config_mismatch(arch: DitArchitecture, cfg: dict) -> Optional[str]:
    """Why a DiT of ``arch`` cannot be the model ``config.json`` (``cfg``) builds (the cause; the
    fix is :data:`FIX_FILE`), or None."""
    if not arch.kind:
        return "it is not a Wan DiT (no head.modulation or patch_embedding: a VAE, a text encoder or a LoRA?)"
    if arch.kind is not WanKind.S2V:
        return f"this is a Wan {arch.kind.value} DiT (no audio modules), not S2V"
    want = {"dim": arch.dim, "in_dim": arch.in_dim, "ffn_dim": arch.ffn_dim, "num_layers": arch.num_layers,
            "audio_inject_layers": arch.audio_layers}
    for key, got in want.items():
        expected = cfg.get(key)
        if key == "audio_inject_layers" and isinstance(expected, list):
            expected = len(expected)
        if expected is not None and int(expected) != got:
            return (f"it has {key} {got}, CKPT_DIR's config.json {expected}: the file is another model's "
                    f"({arch.describe()})")
    return None
