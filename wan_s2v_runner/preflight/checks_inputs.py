"""Groups ``inputs`` and ``output``: the flags make a valid spec; the prompt; the reference image
decodes (size, mode, EXIF rotation) and the engine's size fit gives a usable frame size; the
audio decodes the way the engine's ``librosa.load`` does (libsndfile, then audioread), has a
duration wav2vec2 can take, and implies a clip count; the output/run directories are writable
(a temp file is created and removed, nothing is left) and their disk has room.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from wan_s2v_runner.shared.spec import ROPE_POSITIONS

from .core import fail, ok, skip, warn
from .geometry import FPS, PATCH, VAE_STRIDE, clips_for_audio, generation_size, output_frames

W2V_MIN_SAMPLES = 400  # wav2vec2's conv feature encoder has a 400-sample (25 ms @ 16 kHz) receptive field
MAX_UPSCALE = 2.0
MAGIC = ((b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
         (b"%PDF", "a PDF document"), (b"PK\x03\x04", "a zip archive"), (b"<!DOCTYPE", "an HTML page"),
         (b"<html", "an HTML page"), (b"{", "a JSON/text file"))


def sniff(path: Path) -> Optional[str]:
    """What a file really is by its first bytes, for the formats people mix up with audio."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    for magic, what in MAGIC:
        if head.lower().startswith(magic.lower()) if magic.startswith(b"<") else head.startswith(magic):
            return what
    return None


# --------------------------------------------------------------------------- inputs
def check_flags(ctx):
    if ctx.spec_error:
        first = ctx.spec_error.splitlines()[0].removeprefix("error: ").removeprefix("spec: ")
        cause, _, fix = first.partition(" Fix: ")
        return fail("inputs.flags", cause.rstrip("."), fix or "correct the flags")
    missing = ctx.missing
    if missing:
        return skip("inputs.flags", f"not given: {', '.join('--' + m.replace('_', '-') for m in missing)} "
                    "(environment-only check)")
    return ok("inputs.flags", "flags form a valid run spec")


def check_prompt(ctx):
    if ctx.spec.prompt is None:
        return skip("inputs.prompt", "no --prompt given")
    if not ctx.spec.prompt.strip():
        return fail("inputs.prompt", "the prompt is empty", "pass a non-empty --prompt")
    return ok("inputs.prompt", f"{len(ctx.spec.prompt)} characters")


def check_image(ctx):
    p = ctx.spec.image
    if p is None:
        return skip("inputs.image", "no --image given")
    if not p.is_file():
        return fail("inputs.image", f"{p} does not exist" if not p.exists() else f"{p} is not a file",
                    "pass the reference image to --image")
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(p) as im:
            fmt, mode, (w, h) = im.format, im.mode, im.size
            exif = im.getexif() if hasattr(im, "getexif") else {}
            im.load()  # decode the pixels, not just the header
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        what = sniff(p)
        return fail("inputs.image", f"{p.name} does not decode as an image"
                    + (f" (it is {what})" if what and "image" not in what else "") + f": {e}",
                    "pass a PNG/JPEG/WebP reference image")
    ctx.cache["image_size"] = (w, h)
    orient = exif.get(0x0112) if exif else None
    if orient not in (None, 1):
        return warn("inputs.image", f"{fmt} {w}x{h} {mode} with EXIF orientation {orient}: the engine "
                    "ignores EXIF rotation", "save the image upright (e.g. PIL ImageOps.exif_transpose)",
                    width=w, height=h, mode=mode)
    if mode in ("I", "I;16", "I;16B", "I;16L", "F"):
        return warn("inputs.image", f"{fmt} {w}x{h} in 16/32-bit mode {mode}: convert('RGB') clips it",
                    "save it as 8-bit RGB", width=w, height=h, mode=mode)
    return ok("inputs.image", f"{fmt} {w}x{h} {mode}", width=w, height=h, mode=mode)


def check_size(ctx):
    img = ctx.cache.get("image_size")
    if ctx.spec.max_area < 64 * 64:
        return fail("inputs.size", f"--size area {ctx.spec.max_area} px < 64*64: the engine's size fit gives "
                    "a 0-pixel side", "use --size 64*64 or larger (default 1024*704)")
    if img is None:
        return skip("inputs.size", "needs a readable --image (the engine keeps its aspect)")
    w, h = img
    gh, gw = generation_size(h, w, ctx.spec.max_area)
    ctx.cache["gen_size"] = (gw, gh)
    if gh <= 0 or gw <= 0:
        return fail("inputs.size", f"image {w}x{h} at area {ctx.spec.max_area}: the engine's size fit "
                    f"(get_size_less_than_area) gives {gw}x{gh}, which crashes in Resize",
                    "use a larger --size, or an image with a less extreme aspect ratio",
                    gen_width=gw, gen_height=gh)
    side = ROPE_POSITIONS * VAE_STRIDE[1] * PATCH[1]  # px a side the DiT's rotary table can place
    if max(gw, gh) > side:
        return fail("inputs.size", f"image {w}x{h} at area {ctx.spec.max_area} gives {gw}x{gh} frames: the DiT's "
                    f"rotary position table holds {ROPE_POSITIONS} patches ({side} px) a side",
                    f"use a smaller --size, or an image with a less extreme aspect ratio (at most {side} px a side)",
                    gen_width=gw, gen_height=gh)
    up = min(gw, gh) / max(1, min(w, h))  # Resize(min(H, W)) scales the short side
    if up > MAX_UPSCALE:
        return warn("inputs.size", f"image {w}x{h} is upscaled {up:.1f}x to the {gw}x{gh} frames "
                    "(the engine pads small images up to multiples of 64): expect a blurry face",
                    f"use an image at least {gw // 2}x{gh // 2} (ideally {gw}x{gh} or larger)",
                    gen_width=gw, gen_height=gh, upscale=round(up, 2))
    note = "" if w * h > ctx.spec.max_area else " (image smaller than --size: generated at its own size)"
    return ok("inputs.size", f"frames {gw}x{gh} for image {w}x{h} at area {ctx.spec.max_area}{note}",
              gen_width=gw, gen_height=gh)


def decode_audio(path: Path) -> tuple[int, int, str, int]:
    """(samples, sample_rate, decoder, non-finite samples): libsndfile first, then librosa.load
    (audioread) like the engine."""
    import numpy as np
    try:
        import soundfile as sf
        data, sr = sf.read(str(path), dtype="float32", always_2d=True)
        return int(data.shape[0]), int(sr), "libsndfile", int((~np.isfinite(data)).sum())
    except Exception:  # noqa: BLE001 - fall through to librosa's fallback decoders
        pass
    import warnings

    import librosa
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, sr = librosa.load(str(path), sr=None, mono=True)
    return int(y.shape[-1]), int(sr), "audioread", int((~np.isfinite(y)).sum())


def check_audio(ctx):
    p = ctx.spec.audio
    if p is None and getattr(ctx.spec, "tts_text", None):
        return skip("inputs.audio", "the speech is made from --tts-text at run time (see inputs.tts)")
    if p is None:
        return skip("inputs.audio", "no --audio given")
    if not p.is_file():
        return fail("inputs.audio", f"{p} does not exist" if not p.exists() else f"{p} is not a file",
                    "pass the speech file to --audio")
    if p.stat().st_size == 0:
        return fail("inputs.audio", f"{p.name} is 0 bytes", "pass a real audio file (wav, mp3, flac, ...)")
    try:
        n, sr, how, bad = decode_audio(p)
    except Exception as e:  # noqa: BLE001
        what = sniff(p)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return fail("inputs.audio", f"{p.name} does not decode as audio"
                    + (f": it is really {what} (by its first bytes)" if what else f" ({type(e).__name__}: {msg})"),
                    "convert it to wav: ffmpeg -i IN -ac 1 -ar 16000 speech.wav")
    secs = n / sr if sr else 0.0
    if bad:
        return fail("inputs.audio", f"{p.name} decodes to {bad} samples that are NaN or infinite: wav2vec2's "
                    "normalisation turns the whole clip into NaN", "re-export the audio (e.g. ffmpeg -i IN -ac 1 "
                    "-ar 16000 -c:a pcm_s16le speech.wav)")
    if n == 0 or secs == 0:
        return fail("inputs.audio", f"{p.name} decodes to 0 samples (duration 0 s)", "pass audio with speech in it")
    if secs * 16000 < W2V_MIN_SAMPLES:
        return fail("inputs.audio", f"{p.name} is {secs * 1000:.1f} ms; wav2vec2 needs at least 25 ms "
                    f"({W2V_MIN_SAMPLES} samples at 16 kHz)", "pass longer audio")
    ctx.cache["audio_seconds"] = secs
    natural = clips_for_audio(secs, ctx.spec.infer_frames)
    clips = clips_for_audio(secs, ctx.spec.infer_frames, ctx.spec.num_clips)
    frames = output_frames(clips, ctx.spec.infer_frames, ctx.spec.start_from_ref)
    ctx.cache["n_clips"] = clips
    finding = (f"{secs:.2f} s at {sr} Hz ({how}) -> {clips} clip{'s' if clips > 1 else ''} of "
               f"{ctx.spec.infer_frames} frames = {frames} frames ({frames / FPS:.1f} s)")
    if ctx.spec.num_clips and ctx.spec.num_clips > natural:
        return warn("inputs.audio", finding + f"; --num-clips {ctx.spec.num_clips} exceeds the {natural} the audio "
                    "allows (the engine caps it)", f"use --num-clips {natural} or less, or longer audio",
                    seconds=secs, clips=clips)
    return ok("inputs.audio", finding, seconds=round(secs, 3), clips=clips, frames=frames)


_ORDINAL = {2: "nd", 3: "rd"}


def check_pose_video(ctx):
    """``--pose-video``: it decodes; its frame count, rate and size; how many of the frames the
    clips take it has (upstream samples every round(fps / 16)-th frame and pads past the end)."""
    p = getattr(ctx.spec, "pose_video", None)
    if p is None:
        return skip("inputs.pose_video", "no --pose-video")
    if not p.is_file():
        return fail("inputs.pose_video", f"{p} does not exist" if not p.exists() else f"{p} is not a file",
                    "pass the pose video (mp4, webm, ...) to --pose-video")
    from wan_s2v_runner.shared.pose_video import PoseVideoError, video_facts
    what = sniff(p)
    if what and "image" in what:  # ffmpeg would read it as a video of one frame
        return fail(
            "inputs.pose_video",
            f"{p.name} is {what}, not a video: one pose for one frame, then blank ones",
            "pass the pose sequence as a video: ffmpeg -framerate 16 -i pose_%04d.png -pix_fmt yuv420p pose.mp4",
        )
    try:
        facts = video_facts(p)
    except PoseVideoError as e:
        return fail("inputs.pose_video", f"{p.name} does not decode as a video" + (f" (it is {what})" if what else "")
                    + f": {e}", "pass a video file: ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p pose.mp4")
    if facts.frames == 0:
        return fail("inputs.pose_video", f"{p.name} has no frames", "pass a pose video with frames in it")
    step = facts.interval()
    every = "frame" if step == 1 else f"{step}{_ORDINAL.get(step, 'th')} frame"
    found = (f"{p.name}: {facts.frames} frames {facts.width}x{facts.height} at {facts.fps:g} fps "
             f"(every {every} at 16 fps)")
    data = dict(frames=facts.frames, fps=facts.fps, width=facts.width, height=facts.height, interval=step)
    clips = ctx.cache.get("n_clips")
    if clips is None:
        return ok("inputs.pose_video", found + "; the clip count comes from the speech at run time", **data)
    need = clips * ctx.spec.infer_frames
    have = facts.sampled(need)
    gen = ctx.cache.get("gen_size")
    if have < need:
        return warn(
            "inputs.pose_video",
            found + f": {have} of the {need} frames {clips} clip{'s' if clips > 1 else ''} "
            f"take; the last {need - have} are padded with blank pose frames, as upstream pads",
            f"a pose video of at least {(need - 1) * step + 1} frames at this rate covers every clip",
            padded=need - have,
            **data,
        )
    if gen is not None and abs(facts.width / facts.height - gen[0] / gen[1]) > 0.1 * gen[0] / gen[1]:
        return warn("inputs.pose_video", found + f"; its aspect differs from the {gen[0]}x{gen[1]} frames: the "
                    "centre crop cuts its sides", "render the poses at the reference image's aspect ratio", **data)
    return ok("inputs.pose_video", found + f": all {need} frames of {clips} clip{'s' if clips > 1 else ''}", **data)


# --------------------------------------------------------------------------- output
def _existing_ancestor(p: Path) -> Path:
    a = p
    while not a.exists() and a != a.parent:
        a = a.parent
    return a


def writable_dir(target_dir: Path) -> tuple[bool, str, Path]:
    """Whether files can be created in ``target_dir`` (created if missing). Leaves nothing."""
    a = _existing_ancestor(target_dir)
    if not a.is_dir():
        return False, f"{a} is a file, so {target_dir} cannot be created", a
    try:
        fd, tmp = tempfile.mkstemp(prefix=".wan-s2v-preflight-", dir=a)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return False, f"cannot create files in {a}: {e.strerror or e}", a
    return True, ("" if a == target_dir else f"{target_dir} will be created under {a}"), a


def check_output_dir(ctx):
    if ctx.spec.output is None:
        return skip("output.dir", "no --output")
    good, why, _ = writable_dir(ctx.spec.output.parent)
    if not good:
        return fail("output.dir", f"output directory not writable: {why}",
                    "choose an --output in a writable directory")
    if ctx.spec.output.is_dir():
        return fail("output.dir", f"--output {ctx.spec.output} is a directory", "pass a file name ending in .mp4")
    if ctx.spec.output.exists():
        return warn(
            "output.dir", f"{ctx.spec.output} exists and will be replaced", "choose another --output to keep it"
        )
    return ok("output.dir", f"{ctx.spec.output.parent} writable" + (f" ({why})" if why else ""))


#: the disk check warns when the job would fill more than this share of a filesystem's free space,
#: or leave less than DISK_WARN_LEFT
DISK_WARN_SHARE = 0.8
DISK_WARN_LEFT = 2**30


def _filesystem(ctx, path: Path) -> Optional[dict]:
    """The filesystem that will hold ``path``: measured on a live machine (``probe.filesystem``),
    else as the recorded facts have it (``disks``); None when unknown."""
    if ctx.facts.live:
        from .probe import filesystem
        return filesystem(path)
    return ctx.facts.filesystem(path)


def disk_needs(ctx) -> list[tuple[str, Path, int]]:
    """(what, where, bytes) the job writes, by ``shared.video_budget``'s rule, for the clips and
    size the memory plan uses (:func:`.memory.workload`)."""
    from wan_s2v_runner.shared.video_budget import disk_plan

    from .memory import workload
    wl = workload(ctx)
    plan = disk_plan(wl.n_clips, wl.infer_frames, wl.height, wl.width, wl.start_from_ref,
                     frames_out=ctx.spec.frames_out is not None)
    out = [("the mp4", ctx.spec.output.parent, plan.output)]
    if ctx.spec.runs_root is not None:
        out.append(("clips/state_NNNN.pt", ctx.spec.runs_root, plan.run_dir))
    if ctx.spec.frames_out is not None:
        out.append(("--frames-out", ctx.spec.frames_out.parent, plan.frames_out))
    return out


def check_disk(ctx):
    """Free space on the filesystems the job writes to (the output's, the run directory's,
    ``--frames-out``'s) against what it writes there (``shared.video_budget``: the mp4 at a
    stated bit rate, the carried state clips/state_NNNN.pt, the raw frames)."""
    if ctx.spec.output is None:
        return skip("output.disk", "no --output")
    if not _existing_ancestor(ctx.spec.output.parent).is_dir():
        return skip("output.disk", "output directory unusable (see output.dir)")
    from .memory import workload
    clips = workload(ctx).n_clips
    per_fs: dict[str, dict] = {}
    unknown = []
    for what, where, need in disk_needs(ctx):
        fs = _filesystem(ctx, where)
        if fs is None:
            unknown.append(f"{what} ~{_size(need)}")
            continue
        entry = per_fs.setdefault(fs["path"], {"free": fs["free_mib"] * 2**20, "need": 0, "what": []})
        entry["need"] += need
        entry["what"].append(f"{what} ~{_size(need)}")
    data = {"clips": clips, "filesystems": {k: {"free": v["free"], "need": v["need"]} for k, v in per_fs.items()}}
    if not per_fs:
        why = "unreadable" if ctx.facts.live else "the recorded facts list no disks"
        return skip("output.disk", f"free space unknown ({why}); {clips} clip(s) write {', '.join(unknown)}", **data)
    lines = [f"{_size(v['free'])} free on {k} for {' + '.join(v['what'])}" for k, v in per_fs.items()]
    detail = "; ".join(lines) + f" ({clips} clip(s))"
    if unknown:
        detail += f"; unknown free space for {', '.join(unknown)}"
    short = [(k, v) for k, v in per_fs.items() if v["need"] > v["free"]]
    if short:
        k, v = short[0]
        return fail("output.disk", f"not enough disk for the job: {k} has {_size(v['free'])} free, the job writes "
                    f"~{_size(v['need'])} there ({' + '.join(v['what'])}; {clips} clip(s))",
                    f"free {_size(v['need'] - v['free'])} on {k}, or point --output/--runs-root at a filesystem "
                    "with room (fewer --num-clips or a smaller --size writes less)", **data)
    close = [(k, v) for k, v in per_fs.items()
             if v["need"] > DISK_WARN_SHARE * v["free"] or v["free"] - v["need"] < DISK_WARN_LEFT]
    if close:
        k, v = close[0]
        return warn("output.disk", f"close to full: {detail}", f"free some space on {k} (the job leaves "
                    f"{_size(v['free'] - v['need'])})", **data)
    return ok("output.disk", detail, **data)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_runs_root(ctx):
    if ctx.spec.runs_root is None:
        return skip("output.runs_root", "no --runs-root")
    good, why, _ = writable_dir(ctx.spec.runs_root)
    if not good:
        return fail("output.runs_root", f"run directories cannot be created: {why}",
                    "pass a writable --runs-root")
    return ok("output.runs_root", f"{ctx.spec.runs_root} writable" + (f" ({why})" if why else ""))


def check_frames_out(ctx):
    if ctx.spec.frames_out is None:
        return skip("output.frames_out", "no --frames-out")
    good, why, _ = writable_dir(ctx.spec.frames_out.parent)
    if not good:
        return fail("output.frames_out", f"--frames-out directory not writable: {why}",
                    "choose a writable --frames-out")
    return ok("output.frames_out", f"{ctx.spec.frames_out.parent} writable")
