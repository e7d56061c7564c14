"""Groups ``engine`` and ``media``: where the Wan2.2 engine comes from (package or checkout),
its version and whether its S2V files match the upstream fingerprint (read from disk, ``wan``
is never imported here); the Python packages ``import wan`` needs and their version pairings;
the bundled ffmpeg runs and really encodes H.264 + AAC (a 0.25 s clip to a temp file).
"""
from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from wan_s2v_runner.shared import engine_source

from .core import fail, ok, warn

#: import name -> (pip name, who needs it)
REQUIRED_MODULES = {
    "torchvision": ("torchvision", "wan (transforms)"),
    "transformers": ("transformers", "T5 tokenizer, wav2vec2"),
    "diffusers": ("diffusers", "WanModel_S2V (ModelMixin)"),
    "huggingface_hub": ("huggingface-hub", "transformers/diffusers"),
    "accelerate": ("accelerate", "diffusers from_pretrained(device_map=...)"),
    "peft": ("peft", "`import wan` (wan/__init__ imports the animate pipeline)"),
    "decord": ("decord", "`import wan` (speech2video.py imports decord at the top)"),
    "cv2": ("opencv-python-headless", "`import wan` (animate pipeline)"),
    "librosa": ("librosa", "audio loading (AudioEncoder)"),
    "safetensors": ("safetensors", "DiT weights"),
    "tokenizers": ("tokenizers", "T5 tokenizer"),
    "einops": ("einops", "wan modules"),
    "easydict": ("easydict", "wan configs"),
    "ftfy": ("ftfy", "T5 prompt cleaning"),
    "regex": ("regex", "T5 prompt cleaning"),
    "imageio": ("imageio", "wan.utils"),
    "imageio_ffmpeg": ("imageio-ffmpeg", "the ffmpeg binary for the mp4"),
    "soundfile": ("soundfile", "audio decoding (librosa)"),
    "PIL": ("pillow", "reference image"),
    "tqdm": ("tqdm", "wan sampling loop"),
}


def V(s):
    try:
        return Version(str(s)) if s else None
    except InvalidVersion:
        return None


def check_located(ctx):
    try:
        loc = engine_source.locate(ctx.spec.wan_repo)
    except engine_source.EngineNotFound as e:
        cause, _, fix = str(e).partition(" Fix: ")
        return fail("engine.found", cause.strip(), fix.strip() or "pip install --no-deps wan22==2.2.11")
    ctx.cache["engine_location"] = loc
    where = f"package wan22 {engine_source.engine_version(loc)}" if loc.source == "package" \
        else f"checkout {loc.repo_root} ({engine_source.engine_version(loc)})"
    return ok("engine.found", f"{where} at {loc.package_dir}", source=loc.source,
              version=engine_source.engine_version(loc), path=str(loc.package_dir))


def check_fingerprint(ctx):
    loc = ctx.cache.get("engine_location")
    if loc is None:
        return fail("engine.fingerprint", "no engine to fingerprint (see engine.found)",
                    "install the engine first")
    hashes = engine_source.s2v_file_hashes(loc.package_dir)
    missing = [rel for rel, h in hashes.items() if h is None]
    if missing:
        return fail("engine.fingerprint", f"S2V files missing from {loc.package_dir}: {', '.join(missing)}",
                    "reinstall: pip install --no-deps --force-reinstall wan22==2.2.11 (or update the checkout)")
    fp = engine_source.s2v_fingerprint(loc.package_dir)
    if fp != engine_source.KNOWN_S2V_FINGERPRINT:
        return warn("engine.fingerprint", f"S2V files differ from upstream Wan2.2 42bf4cf (fingerprint "
                    f"{fp[:12]}, expected {engine_source.KNOWN_S2V_FINGERPRINT[:12]})",
                    "the patches were tested against upstream 42bf4cf / wan22 2.2.11; use that version "
                    "or re-run the test suite against this one", fingerprint=fp)
    return ok("engine.fingerprint", f"{len(hashes)} S2V files match upstream 42bf4cf ({fp[:12]})", fingerprint=fp)


def check_deps(ctx):
    f = ctx.facts
    missing = [(mod, pip, why) for mod, (pip, why) in REQUIRED_MODULES.items() if f.module(mod) is False]
    if missing:
        mod, pip, why = missing[0]
        names = " ".join(p for _, p, _ in missing)
        return fail("engine.deps", f"missing {', '.join(m for m, _, _ in missing)} (needed by {why}"
                    f"{' and others' if len(missing) > 1 else ''})",
                    f"pip install {names} (versions: requirements.txt)", missing=[m for m, _, _ in missing])
    pk = {n: V(f.package(n)) for n in ("diffusers", "transformers", "huggingface-hub", "accelerate",
                                        "peft", "librosa", "decord")}
    problems = []
    d, t, h = pk["diffusers"], pk["transformers"], pk["huggingface-hub"]
    if d and h and d >= Version("0.42") and h < Version("1.32"):
        problems.append((f"diffusers {d} needs huggingface-hub >= 1.32, found {h}",
                         "pip install 'huggingface-hub>=1.32' 'transformers>=5' (or diffusers<0.42)"))
    if h and t and h >= Version("1.0") and t < Version("5"):
        problems.append((f"huggingface-hub {h} is 1.x but transformers {t} is 4.x (needs hub < 1.0)",
                         "pip install 'transformers>=5' (e.g. 5.23.0), or pin huggingface-hub<1 with diffusers<0.42"))
    if h and t and t >= Version("5") and h < Version("1.0"):
        problems.append((f"transformers {t} needs huggingface-hub >= 1.0, found {h}",
                         "pip install 'huggingface-hub>=1.32'"))
    for c in f.raw.get("dep_conflicts") or []:
        problems.append((c, "pip install the versions in requirements.txt"))
    shown = ", ".join(f"{n} {v}" for n, v in pk.items() if v)
    if problems:
        return fail("engine.deps", problems[0][0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""),
                    problems[0][1], problems=[p for p, _ in problems], versions=shown)
    return ok("engine.deps", shown or "dependencies present")


# --------------------------------------------------------------------------- media
@functools.lru_cache(maxsize=4)
def _ffmpeg_probe(exe: str) -> tuple[bool, str, bool, str]:
    """(runs, version line, encodes, error) for an ffmpeg binary; cached per process."""
    try:
        p = subprocess.run([exe, "-hide_banner", "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, "", False, f"{type(e).__name__}: {e}"
    if p.returncode != 0:
        return False, "", False, (p.stderr or p.stdout).strip()[-200:]
    line = (p.stdout.splitlines() or ["ffmpeg"])[0]
    with tempfile.TemporaryDirectory(prefix="wan-s2v-ffmpeg-") as d:
        out = Path(d) / "probe.mp4"
        cmd = [exe, "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
               "-f", "lavfi", "-i", "color=c=gray:s=64x64:r=16:d=0.25",
               "-f", "lavfi", "-i", "sine=frequency=440:sample_rate=16000:duration=0.25",
               "-c:v", "libx264", "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest", "-f", "mp4", str(out)]
        try:
            e = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as ex:
            return True, line, False, f"{type(ex).__name__}: {ex}"
        good = e.returncode == 0 and out.is_file() and out.stat().st_size > 0
        err = "" if good else ((e.stderr or "").strip().splitlines() or [f"exit {e.returncode}"])[-1]
    return True, line, good, err


def check_ffmpeg(ctx):
    from wan_s2v_runner.shared import media
    try:
        exe = media.ffmpeg_exe()
    except media.MediaError as e:
        return fail("media.ffmpeg", f"no ffmpeg binary: {e}".split(". Fix:")[0],
                    "pip install imageio-ffmpeg==0.8.1 (it ships ffmpeg; no system ffmpeg needed)")
    runs, line, encodes, err = _ffmpeg_probe(exe)
    if not runs:
        return fail("media.ffmpeg", f"{exe} does not run: {err}", "pip install --force-reinstall imageio-ffmpeg")
    ctx.cache["ffmpeg"] = (exe, line, encodes, err)
    return ok("media.ffmpeg", f"{line.split(' Copyright')[0]} ({exe})", path=exe)


def check_encode(ctx):
    got = ctx.cache.get("ffmpeg")
    if got is None:
        return fail("media.encode", "no working ffmpeg (see media.ffmpeg)", "install imageio-ffmpeg")
    exe, _, encodes, err = got
    if not encodes:
        return fail("media.encode", f"ffmpeg cannot encode H.264 + AAC: {err}",
                    "use the imageio-ffmpeg binary (it has libx264 and aac): pip install imageio-ffmpeg==0.8.1")
    return ok("media.encode", "encoded a 0.25 s H.264 + AAC test clip")
