"""Synthetic demo inputs: a small face-like reference image, a speech-like audio clip and a pose
video.

Deterministic for a seed (same seed, same bytes), built from nothing (no downloads), good enough
to drive the engine end to end: ``make_reference_image`` draws a cartoon head-and-shoulders
portrait (RGB PNG); ``make_speech_audio`` writes a mono 16-bit WAV with a voiced glottal source,
a pitch contour, vowel formants and ~4 Hz syllables (wav2vec2 sees speech-like features);
``make_pose_video`` renders a DWPose-style skeleton (coloured limbs on black) waving its arms, as
an H.264 mp4.
"""
from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

__all__ = ["make_reference_image", "make_speech_audio", "make_pose_video"]


def make_reference_image(path: Path, width: int = 64, height: int = 64, seed: int = 0) -> Path:
    """Write a simple cartoon head-and-shoulders portrait (RGB PNG) to ``path``."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    path = Path(path)
    w, h = int(width), int(height)
    if w < 8 or h < 8:
        raise ValueError(f"image too small: {w}x{h}")

    def jitter(rgb, amount=18):
        return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)

    img = Image.new("RGB", (w, h))
    top, bottom = jitter((150, 180, 210)), jitter((70, 90, 120))
    px = img.load()
    for y in range(h):  # vertical background gradient
        t = y / max(1, h - 1)
        row = tuple(int(a + (b - a) * t) for a, b in zip(top, bottom))
        for x in range(w):
            px[x, y] = row
    d = ImageDraw.Draw(img)

    def box(cx, cy, rx, ry):
        return [w * (cx - rx), h * (cy - ry), w * (cx + rx), h * (cy + ry)]

    skin, hair, shirt = jitter((224, 180, 150)), jitter((60, 40, 30)), jitter((40, 70, 140))
    d.ellipse(box(0.5, 1.05, 0.42, 0.25), fill=shirt)                  # shoulders
    d.rectangle(box(0.5, 0.78, 0.09, 0.08), fill=skin)                 # neck
    d.ellipse(box(0.5, 0.40, 0.27, 0.32), fill=hair)                   # hair behind the head
    d.ellipse(box(0.5, 0.47, 0.23, 0.29), fill=skin)                   # face
    d.chord(box(0.5, 0.30, 0.25, 0.16), 180, 360, fill=hair)           # fringe
    for ex in (0.41, 0.59):
        d.ellipse(box(ex, 0.45, 0.055, 0.035), fill=(250, 250, 250))   # eye whites
        d.ellipse(box(ex, 0.45, 0.025, 0.025), fill=(40, 30, 20))      # pupils
        d.line([w * (ex - 0.05), h * 0.39, w * (ex + 0.05), h * 0.38], fill=hair,
               width=max(1, w // 48))                                  # eyebrows
    d.line([w * 0.5, h * 0.48, w * 0.48, h * 0.56, w * 0.52, h * 0.56], fill=jitter((180, 130,
           110)), width=max(1, w // 64))                               # nose
    d.ellipse(box(0.5, 0.64, 0.08, 0.03), fill=jitter((170, 60, 60)))  # mouth
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
    return path


def _speech_like(seconds: float, sr: int, seed: int) -> np.ndarray:
    """Voiced glottal source with a pitch contour, vowel formants, ~4 Hz syllables, some noise."""
    from scipy.signal import lfilter

    rng = np.random.default_rng(seed)
    n = max(1, int(round(seconds * sr)))
    t = np.arange(n) / sr
    # Pitch: ~120 Hz, slow declination, intonation wobble, a little jitter.
    f0 = (120.0 + rng.uniform(-10, 10) + 18.0 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6.3))
          - 8.0 * t / max(seconds, 1e-3))
    f0 *= 1.0 + 0.01 * rng.standard_normal(n).cumsum() / np.sqrt(np.arange(1, n + 1))
    phase = np.cumsum(f0 / sr) % 1.0
    # Rosenberg glottal pulse (open 40%, close 16%), differentiated for lip radiation.
    tp, tn = 0.40, 0.16
    flow = np.where(phase < tp, 0.5 * (1 - np.cos(np.pi * phase / tp)),
                    np.where(phase < tp + tn, np.cos(0.5 * np.pi * (phase - tp) / tn), 0.0))
    source = np.diff(flow, prepend=flow[0]) * sr / 200.0
    source += 0.02 * rng.standard_normal(n)  # aspiration
    # Syllables at ~4 Hz, each a vowel with its own formants (F1, F2, F3 in Hz).
    vowels = [(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480),
              (570, 840, 2410)]
    syl = 0.25 * rng.uniform(0.85, 1.15)
    out = np.zeros(n)
    env = np.zeros(n)
    start, k = 0, 0
    while start < n:
        length = int(syl * sr * rng.uniform(0.8, 1.2))
        end = min(n, start + length)
        seg = source[start:end]
        y = np.zeros_like(seg)
        for i, fc in enumerate(vowels[(k + int(rng.integers(0, 5))) % len(vowels)]):
            bw = 60.0 + 40.0 * i
            r = np.exp(-np.pi * bw / sr)
            a = [1.0, -2 * r * np.cos(2 * np.pi * fc / sr), r * r]
            y += lfilter([1.0 - r], a, seg) * (0.6 ** i)
        out[start:end] = y
        m = end - start
        u = np.linspace(0.0, 1.0, m, endpoint=False)
        # Rise and fall within the syllable, a short near-silent gap at its end.
        env[start:end] = np.clip(np.sin(np.pi * np.clip(u / 0.85, 0, 1)), 0, 1) ** 1.5
        start, k = end, k + 1
    out = out * env + 0.003 * rng.standard_normal(n)
    peak = float(np.max(np.abs(out))) or 1.0
    return (0.6 * out / peak).astype(np.float32)


def make_speech_audio(path: Path, seconds: float = 1.0, sample_rate: int = 16000,
                      seed: int = 0) -> Path:
    """Write a synthetic speech-like mono WAV (16-bit PCM) to ``path``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    path = Path(path)
    x = _speech_like(float(seconds), int(sample_rate), seed)
    pcm = np.clip(np.round(x * 32767.0), -32768, 32767).astype("<i2")
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.tobytes())
    return path


#: DWPose-style body: joints (x, y as fractions of the frame) and coloured limbs between them
_JOINTS = {"nose": (0.50, 0.30), "neck": (0.50, 0.50), "r_sh": (0.36, 0.52), "l_sh": (0.64, 0.52),
           "r_hip": (0.42, 0.95), "l_hip": (0.58, 0.95)}
_LIMBS = [("nose", "neck", (0, 0, 255)), ("neck", "r_sh", (255, 0, 0)), ("neck", "l_sh", (255, 85, 0)),
          ("neck", "r_hip", (0, 255, 0)), ("neck", "l_hip", (0, 255, 255))]


def make_pose_video(path: Path, width: int = 96, height: int = 80, frames: int = 30, fps: float = 25.0,
                    seed: int = 0) -> Path:
    """Write a pose video (H.264 mp4, yuv420p): a skeleton whose arms wave and head sways."""
    import imageio_ffmpeg
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    phase, speed = rng.uniform(0, 2 * np.pi), rng.uniform(0.25, 0.35)
    w, h = int(width), int(height)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    gen = imageio_ffmpeg.write_frames(str(path), (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
                                      macro_block_size=1, quality=8, ffmpeg_log_level="error")
    gen.send(None)
    line = max(1, w // 24)
    for i in range(int(frames)):
        a = phase + speed * i
        joints = dict(_JOINTS)
        joints["nose"] = (0.50 + 0.04 * np.sin(a), 0.30)
        for side, sign in (("r", -1), ("l", 1)):
            sx, sy = joints[f"{side}_sh"]
            ex, ey = sx + sign * 0.12, sy + 0.10 + 0.08 * np.sin(a + (sign > 0) * np.pi)
            hx, hy = ex + sign * 0.05, ey - 0.18 * (0.5 + 0.5 * np.sin(a * 1.3 + (sign > 0)))
            joints[f"{side}_el"], joints[f"{side}_wr"] = (ex, ey), (hx, hy)
        img = Image.new("RGB", (w, h))
        d = ImageDraw.Draw(img)
        limbs = _LIMBS + [("r_sh", "r_el", (255, 170, 0)), ("r_el", "r_wr", (255, 255, 0)),
                          ("l_sh", "l_el", (170, 255, 0)), ("l_el", "l_wr", (85, 255, 0))]
        for j1, j2, colour in limbs:
            (x1, y1), (x2, y2) = joints[j1], joints[j2]
            d.line([x1 * w, y1 * h, x2 * w, y2 * h], fill=colour, width=line)
        for x, y in joints.values():
            d.ellipse([x * w - line, y * h - line, x * w + line, y * h + line], fill=(255, 255, 255))
        gen.send(np.ascontiguousarray(np.asarray(img)))
    gen.close()
    return path
