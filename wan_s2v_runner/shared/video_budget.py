"""What a job's video costs outside the model: rank 0's host memory for frames, and the disk its
output takes. One rule, pure arithmetic (its frame counts are ``shared.media``'s): the memory plan and the disk check
(``preflight``) call it, and the rank's streaming video writer cites it for what it may hold.

Host memory (rank 0, the decoding rank) is **flat in the clip count**: the streaming writer holds
at most :data:`FLOAT_CLIPS` clips of decoded float32 frames (``infer_frames`` frames of 3 x H x W
each: the clip just decoded and the one being converted), one clip of uint8 frames being encoded,
and, on CPU runs, the last :data:`MOTION_FRAMES` frames in float32 that the next clip re-encodes
as motion (on CUDA those stay on the GPU). Nothing grows with the number of clips.
``--frames-out`` (a parity lever) writes every float32 frame to disk as it comes (a raw file, then
one ``torch.save`` from a memory map of it at the end): disk, not RAM.

Disk: the mp4 (H.264 at crf 10 + AAC at :data:`AUDIO_BITS_PER_S`), written as it grows, on the
output's filesystem; the clip checkpoint's carried state in the run directory
(``clips/state_NNNN.pt``: the motion latents, plus the last 73 frames in float32 only where a later
clip reads them, i.e. clips shorter than 73 frames), the newest one and, while it is committed,
the one before; with ``--frames-out``, the raw
frames and the ``.pt`` made from them, side by side at the end.

The mp4's size is a rule of thumb, stated once here: :data:`MP4_BITS_PER_PIXEL` bits per pixel
per frame. Why 0.5: crf 10 is near-lossless (grain and texture are kept), but a talking head is a
mostly still background and one moving face, which x264 predicts well from frame to frame; such
video at crf 18 is commonly ~0.05-0.1 bit/pixel and each 6 crf steps roughly doubles the rate, so
crf 10 lands near 0.15-0.3. 0.5 is a ceiling above that (busy backgrounds, noisy generations), so
the disk check errs on the side of room: ~5.8 Mbit/s at 1024x704 and 16 fps, ~0.43 GB for ten
minutes. It is not a measurement of this project's videos: a run's manifest has the real size.
"""
from __future__ import annotations

from dataclasses import dataclass

#: frames carried from one clip to the next (config.transformer.motion_frames), and their latent
#: frames (19 for 73): the DiT's rules, written in ``shared.dit_cost`` (which the spec reads
#: without this module's media imports) and read here
from wan_s2v_runner.shared.dit_cost import MOTION_FRAMES, motion_latent_frames

#: the engine's frame rate, and the frames a video has fewer than its clips (the first clip's
#: motion frames): N clips of F frames make N * F - 3 frames (one rule: ``shared.media``'s)
from wan_s2v_runner.shared.media import FIRST_CLIP_DROPS, FPS

#: the motion latents state.pt keeps: 16 channels x 19 latent frames at 1/8 of the size, float32
MOTION_LATENT_CHANNELS, MOTION_LATENT_FRAMES = 16, motion_latent_frames()
#: decoded float32 clips the streaming writer holds at most (the one decoded, the one converted)
FLOAT_CLIPS = 2
#: uint8 clips it holds while the encoder takes them
UINT8_CLIPS = 1
#: the mp4's video, in bits per pixel per frame at crf 10 (conservative: module docstring)
MP4_BITS_PER_PIXEL = 0.5
#: the mp4's audio: AAC at 128 kbit/s (``media.AUDIO_BIT_RATE``)
AUDIO_BITS_PER_S = 128_000


def video_frames(clips: int, infer_frames: int, start_from_ref: bool = False) -> int:
    """Frames of the final video: ``infer_frames`` per clip, less 3 on a first clip that drops its
    motion frames (every run that does not start from the reference image)."""
    return max(0, clips * infer_frames - (0 if start_from_ref else FIRST_CLIP_DROPS))


def host_frame_bytes(height: int, width: int, infer_frames: int, on_cpu: bool = False) -> int:
    """Rank 0's host bytes for frames at any clip count (module docstring): the same for 1 clip
    and 1000."""
    pixels = 3 * height * width
    held = FLOAT_CLIPS * infer_frames * pixels * 4 + UINT8_CLIPS * infer_frames * pixels
    return held + (MOTION_FRAMES * pixels * 4 if on_cpu else 0)


def state_bytes(height: int, width: int, infer_frames: int = 80) -> int:
    """The carried state's files (``clips/state_NNNN.pt``, two while one is committed): the motion
    latents, and the last 73 frames (float32) where clips are shorter than them; constant per job."""
    frames = MOTION_FRAMES * 3 * height * width * 4 if infer_frames < MOTION_FRAMES else 0
    latents = MOTION_LATENT_CHANNELS * MOTION_LATENT_FRAMES * (height // 8) * (width // 8) * 4
    return 2 * (frames + latents)


def mp4_bytes(frames: int, height: int, width: int, fps: int = FPS) -> int:
    """The mp4's planned size: :data:`MP4_BITS_PER_PIXEL` per pixel per frame + the AAC track."""
    video = frames * height * width * MP4_BITS_PER_PIXEL / 8
    audio = frames / fps * AUDIO_BITS_PER_S / 8
    return int(video + audio)


def frames_out_bytes(frames: int, height: int, width: int) -> int:
    """``--frames-out``: the raw float32 frames and the ``.pt`` saved from them, both at the end."""
    return 2 * 3 * frames * height * width * 4


@dataclass(frozen=True)
class DiskPlan:
    """Bytes a job writes: ``output`` on the output's filesystem (the mp4), ``run_dir`` in the run
    directory (the carried state), ``frames_out`` where ``--frames-out`` points (0 without it)."""

    output: int
    run_dir: int
    frames_out: int = 0

    @property
    def total(self) -> int:
        return self.output + self.run_dir + self.frames_out


def disk_plan(clips: int, infer_frames: int, height: int, width: int, start_from_ref: bool = False,
              frames_out: bool = False) -> DiskPlan:
    """What a job of ``clips`` clips at ``width`` x ``height`` writes where (:class:`DiskPlan`)."""
    n = video_frames(clips, infer_frames, start_from_ref)
    return DiskPlan(mp4_bytes(n, height, width), state_bytes(height, width, infer_frames),
                    frames_out_bytes(n, height, width) if frames_out else 0)
