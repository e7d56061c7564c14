"""Group ``checkpoint``: the Wan2.2-S2V-14B directory is complete and every file is readable,
without reading tensors: expected entries present, every shard the safetensors index names
exists and holds the tensors the index says, safetensors headers parse and match the file
sizes, ``.pth`` files load with ``torch.load(weights_only=True, mmap=True)``, ``config.json``
has the keys ``WanModel_S2V.__init__`` would otherwise silently default, and its dims agree with
the weights. Sizes measured here feed the memory plan (``ctx.cache``).
"""
from __future__ import annotations

import ast
import functools
import json
import math
from pathlib import Path
from typing import Any

from wan_s2v_runner.loading.ckpt_tables import (
    CheckpointFileError,
    find_entry,
    pth_params,
    read_index,
    read_pth_shapes,
    read_safetensors_header,
)
from wan_s2v_runner.shared.ckpt_layout import (
    DIT_CONFIG,
    DIT_INDEX,
    DIT_WEIGHTS,
    DIT_WEIGHTS_ENTRY,
    LAYOUT,
    T5_FILE,
    TINY_INFO_FILE,
    VAE_FILE,
    W2V_WEIGHTS,
    W2V_WEIGHTS_BIN,
    WAV2VEC_DIR,
)
from wan_s2v_runner.shared.dit_cost import S2V_14B, S2V_14B_INJECT_LAYERS

from .core import fail, human_bytes, human_count, ok, skip

#: config.json keys whose absence makes WanModel_S2V build a different model than the
#: checkpoint's (its __init__ defaults are not the S2V-14B values), value in the real config
REQUIRED_CONFIG = {
    "dim": S2V_14B.dim, "ffn_dim": S2V_14B.ffn_dim, "num_heads": S2V_14B.num_heads, "num_layers": S2V_14B.num_layers,
    "in_dim": 16, "out_dim": S2V_14B.out_dim, "audio_dim": 1024, "cond_dim": 16,
    "audio_inject_layers": list(S2V_14B_INJECT_LAYERS),
    "enable_adain": True, "adain_mode": "attn_norm", "enable_framepack": True,
    "framepack_drop_mode": "padd", "enable_motioner": False, "zero_timestep": True,
}
#: the LAYOUT entry a ``--t5-file`` stands in for
T5_WEIGHTS_ENTRY = next(what for what, (alts, _) in LAYOUT.items() if alts == (T5_FILE,))
FIX_DOWNLOAD = ("re-download the missing/broken files: huggingface-cli download Wan-AI/Wan2.2-S2V-14B "
                "--local-dir CKPT_DIR (it resumes and re-fetches bad files)")


def _no_ckpt(ctx, id):
    if ctx.spec.ckpt_dir is None:
        return skip(id, "no --ckpt-dir given (environment-only check)")
    if not ctx.spec.ckpt_dir.is_dir():
        return skip(id, "checkpoint directory missing (see ckpt.dir)")
    return None


def _store(ctx) -> dict:
    return ctx.cache.setdefault("ckpt", {})


@functools.lru_cache(maxsize=8)
def engine_init_defaults(model_s2v_py: str) -> dict[str, Any]:
    """WanModel_S2V.__init__ keyword defaults, read from the engine source with ast."""
    tree = ast.parse(Path(model_s2v_py).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "WanModel_S2V":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    args = fn.args.args[1:]
                    defs = fn.args.defaults
                    out = {}
                    for a, d in zip(args[len(args) - len(defs):], defs):
                        try:
                            out[a.arg] = ast.literal_eval(d)
                        except ValueError:
                            out[a.arg] = ast.unparse(d)
                    return out
    return {}


def check_dir(ctx):
    if ctx.spec.ckpt_dir is None:
        return skip("ckpt.dir", "no --ckpt-dir given (environment-only check)")
    if not ctx.spec.ckpt_dir.exists():
        return fail(
            "ckpt.dir", f"{ctx.spec.ckpt_dir} does not exist", "pass the Wan2.2-S2V-14B directory to --ckpt-dir"
        )
    if not ctx.spec.ckpt_dir.is_dir():
        return fail("ckpt.dir", f"{ctx.spec.ckpt_dir} is not a directory", "pass the checkpoint directory, not a file")
    tiny = (ctx.spec.ckpt_dir / TINY_INFO_FILE).is_file()
    return ok("ckpt.dir", f"{ctx.spec.ckpt_dir}" + (" (random-weight test checkpoint)" if tiny else ""), tiny=tiny)


def check_files(ctx):
    if (r := _no_ckpt(ctx, "ckpt.files")):
        return r
    needed = {what: alts for what, (alts, _) in LAYOUT.items()
              if not (what == DIT_WEIGHTS_ENTRY and ctx.spec.dit_file is not None)  # --dit-file replaces them
              and not (what == T5_WEIGHTS_ENTRY and ctx.spec.t5_file is not None)}  # --t5-file replaces it
    missing = [(what, alts) for what, alts in needed.items() if find_entry(ctx.spec.ckpt_dir, alts) is None]
    if missing:
        desc = "; ".join(f"{' or '.join(alts)}" for _, alts in missing)
        return fail("ckpt.files", f"{len(missing)} expected entr{'y' if len(missing) == 1 else 'ies'} missing: {desc}",
                    FIX_DOWNLOAD, missing=[m for m, _ in missing])
    return ok("ckpt.files", f"all {len(needed)} expected entries present"
              + "".join(f" (the {what}'s weights come from {flag})" for what, flag, given in (
                  ("DiT", "--dit-file", ctx.spec.dit_file), ("T5", "--t5-file", ctx.spec.t5_file)) if given))


def check_index(ctx):
    if (r := _no_ckpt(ctx, "ckpt.index")):
        return r
    if ctx.spec.dit_file is not None:
        return skip("ckpt.index", "the DiT comes from --dit-file (see ckpt.dit_file)")
    idx = ctx.spec.ckpt_dir / DIT_INDEX
    if not idx.is_file():
        if (ctx.spec.ckpt_dir / DIT_WEIGHTS).is_file():
            _store(ctx)["dit_files"] = [DIT_WEIGHTS]
            return ok("ckpt.index", f"single-file DiT ({DIT_WEIGHTS})")
        return skip("ckpt.index", "no DiT weights (see ckpt.files)")
    try:
        wm = read_index(idx)
    except CheckpointFileError as e:
        return fail("ckpt.index", str(e), FIX_DOWNLOAD)
    shards = sorted(set(wm.values()))
    absent = [s for s in shards if not (ctx.spec.ckpt_dir / s).is_file()]
    if absent:
        n = sum(1 for v in wm.values() if v in absent)
        return fail("ckpt.index", f"{DIT_INDEX} names {len(shards)} shards; missing: {', '.join(absent)} "
                    f"({n} tensors)", FIX_DOWNLOAD, missing=absent)
    _store(ctx)["dit_files"] = shards
    _store(ctx)["weight_map"] = wm
    return ok("ckpt.index", f"{len(shards)} shards, {len(wm)} tensors, all present")


def check_safetensors(ctx):
    if (r := _no_ckpt(ctx, "ckpt.safetensors")):
        return r
    st = _store(ctx)
    files = list(st.get("dit_files") or [])
    w2v = ctx.spec.ckpt_dir / W2V_WEIGHTS
    if not files and not w2v.is_file():
        return skip("ckpt.safetensors", "no safetensors files (see ckpt.files)")
    dit: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    headers: dict[str, set] = {}
    total = 0
    for name in files + ([W2V_WEIGHTS] if w2v.is_file() else []):
        p = ctx.spec.ckpt_dir / name
        try:
            info = read_safetensors_header(p)
        except (CheckpointFileError, OSError) as e:
            msg = str(e) if name == Path(name).name else f"{Path(name).parent}/{e}"
            return fail("ckpt.safetensors", msg, FIX_DOWNLOAD, file=name)
        total += info.file_size
        if name.startswith(WAV2VEC_DIR):
            st["w2v_params"] = info.params
            continue
        headers[name] = set(info.tensors)
        dit.update({k: math.prod(s) for k, (_, s) in info.tensors.items()})
        shapes.update({k: tuple(s) for k, (_, s) in info.tensors.items()})
    wm = st.get("weight_map")
    if wm:
        wrong = [k for k, f in wm.items() if k not in headers.get(f, set())]
        if wrong:
            return fail("ckpt.safetensors", f"{len(wrong)} tensors the index maps to a shard are not in it "
                        f"(e.g. {wrong[0]!r} -> {wm[wrong[0]]})", FIX_DOWNLOAD)
    if dit:
        st["dit_tensors"], st["dit_shapes"] = dit, shapes
    n = sum(dit.values())
    return ok("ckpt.safetensors", f"{len(files)} DiT file(s) + wav2vec2: headers match file sizes "
              f"({human_bytes(total)}); DiT {human_count(n)} params", dit_params=n)


def check_pth(ctx):
    if (r := _no_ckpt(ctx, "ckpt.pth")):
        return r
    st = _store(ctx)
    results = []
    for name, key, label in ((T5_FILE, "t5_shapes", "T5"), (VAE_FILE, "vae_shapes", "VAE")):
        p = ctx.spec.ckpt_dir / name
        if not p.is_file():
            continue
        try:
            shapes = read_pth_shapes(p)
        except CheckpointFileError as e:
            return fail("ckpt.pth", str(e), FIX_DOWNLOAD, file=name)
        st[key] = shapes
        results.append(f"{label} {human_count(pth_params(shapes))} params")
    bin_ = ctx.spec.ckpt_dir / W2V_WEIGHTS_BIN
    if "w2v_params" not in st and bin_.is_file():
        try:
            st["w2v_params"] = pth_params(read_pth_shapes(bin_))
        except CheckpointFileError as e:
            return fail("ckpt.pth", f"{WAV2VEC_DIR}/{e}", FIX_DOWNLOAD)
    if not results:
        return skip("ckpt.pth", "no .pth files (see ckpt.files)")
    # the sizes the engine will build, by patches.checkpoint_dims' rules, from the shapes read above
    try:
        from patches.checkpoint_dims import t5_dims_from_shapes, vae_dims_from_shapes
        if "t5_shapes" in st:
            d = t5_dims_from_shapes({k: s for k, (s, _) in st["t5_shapes"].items()}, T5_FILE)
            results.append(f"T5 dim {d['dim']}, {d['num_layers']} layers, {d['num_heads']} heads")
            st["t5_dims"] = d
        if "vae_shapes" in st:
            vd = vae_dims_from_shapes({k: s for k, (s, _) in st["vae_shapes"].items()}, VAE_FILE)
            results.append(f"VAE width {vd['dim']}")
            st["vae_dims"] = vd
            if vd.get("z_dim") != 16:
                return fail("ckpt.pth", f"{VAE_FILE}: z_dim {vd['z_dim']}, the engine's latent statistics "
                            "are 16-channel", FIX_DOWNLOAD)
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - CheckpointLayoutError and friends
        return fail("ckpt.pth", f"loads, but is not the expected model: {e}", FIX_DOWNLOAD)
    return ok("ckpt.pth", "load with weights_only+mmap: " + "; ".join(results))


def check_config(ctx):
    if (r := _no_ckpt(ctx, "ckpt.config")):
        return r
    p = ctx.spec.ckpt_dir / DIT_CONFIG
    if not p.is_file():
        return skip("ckpt.config", "no config.json (see ckpt.files)")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
        assert isinstance(cfg, dict)
    except (ValueError, AssertionError, UnicodeDecodeError) as e:
        return fail("ckpt.config", f"config.json is not a JSON object: {e}", FIX_DOWNLOAD)
    _store(ctx)["config"] = cfg
    missing = [k for k in REQUIRED_CONFIG if k not in cfg]
    if missing:
        defaults = {}
        loc = ctx.cache.get("engine_location")
        if loc is not None:
            try:
                defaults = engine_init_defaults(str(loc.package_dir / "modules/s2v/model_s2v.py"))
            except (OSError, SyntaxError):
                defaults = {}
        k = missing[0]
        dflt = f"WanModel_S2V would use its default {defaults[k]!r}" if k in defaults else "no default"
        return fail("ckpt.config", f"config.json lacks {', '.join(missing)} ({k}: {dflt}; S2V-14B has "
                    f"{REQUIRED_CONFIG[k]!r})", "restore config.json from the Wan2.2-S2V-14B release",
                    missing=missing)
    dim, heads, layers = int(cfg["dim"]), int(cfg["num_heads"]), int(cfg["num_layers"])
    if heads <= 0 or dim % heads or (dim // heads) % 2:
        return fail("ckpt.config", f"dim {dim} is not a multiple of num_heads {heads} with an even head size",
                    "restore config.json from the release")
    dit = _store(ctx).get("dit_tensors")
    pe = None
    if dit is not None:
        # patch_embedding.weight is [dim, in_dim, 1, 2, 2]: numel = dim * in_dim * 4
        pe = dit.get("patch_embedding.weight")
        if pe is not None and pe != dim * int(cfg["in_dim"]) * 4:
            return fail("ckpt.config", f"config.json says dim {dim} x in_dim {cfg['in_dim']} but the weights' "
                        f"patch_embedding has {pe} elements", "config.json and the safetensors are from "
                        "different models; re-download both")
        nblocks = len({k.split('.')[1] for k in dit if k.startswith("blocks.")})
        if nblocks and nblocks != layers:
            return fail("ckpt.config", f"config.json says {layers} layers, the weights have {nblocks} blocks",
                        "config.json and the safetensors are from different models; re-download both")
    ctx.cache["num_heads"] = heads
    return ok("ckpt.config", f"dim {dim}, {heads} heads, {layers} layers, ffn {cfg['ffn_dim']}, "
              f"audio_dim {cfg['audio_dim']}", dim=dim, num_heads=heads, num_layers=layers)
