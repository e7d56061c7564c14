"""The encoders' work a rank group does for each job, made cheaper across jobs and on the GPU.

* :class:`TextContexts`: the T5 encodings of the prompts a group has seen, kept for the group's
  life (a server's group makes many jobs with the same negative prompt, often the same prompt).
  Upstream encodes both for every ``generate`` call, and on one GPU it first moves T5 (11.4 GB) to
  the GPU and back (8.6 s a job at the real size, docs/gpu.md). A text seen before is given its
  stored encoding: the same T5 on the same tokens gave it, so a job's contexts are the ones it
  would have computed (exact). Every rank that encodes text (the text rank; all ranks with an
  FSDP-sharded T5) keeps the same memo, so they agree on whether T5 runs.
* :func:`audio_encoder_on`: wav2vec2 on the GPU for the audio encode where memory allows
  (:mod:`wan_s2v_runner.shared.encoder_placement`'s rule), back on the CPU after.
* :func:`encode_audio`: speech longer than one window is encoded in windows
  (:mod:`wan_s2v_runner.rank.long_audio`); shorter speech is upstream's one pass, unchanged.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Callable, Iterator, Optional, Sequence

import torch

from wan_s2v_runner.rank import long_audio
from wan_s2v_runner.shared import encoder_placement
from wan_s2v_runner.shared.encoder_placement import AudioEncoderDevice

log = logging.getLogger("wan_s2v.encoders")

#: texts remembered per group: a prompt and the negative prompt of a few jobs (a few MB each)
KEEP_TEXTS = 8


class TextContexts:
    """T5 encodings by text, newest last, at most :data:`KEEP_TEXTS` (for one rank group's life)."""

    def __init__(self, keep: int = KEEP_TEXTS):
        self.keep = keep
        self._held: OrderedDict[str, list] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __contains__(self, text: str) -> bool:
        return text in self._held

    def new(self, texts: Sequence[str]) -> list[str]:
        """Which of ``texts`` (each once) T5 must encode."""
        return [t for t in dict.fromkeys(texts) if t not in self._held]

    def get_all(self, texts: Sequence[str], encode: Callable[[str], list]) -> list[list]:
        """The encodings of ``texts``, in order: the stored ones, and ``encode(text)`` for each new
        one (stored). The held ones among them are marked used first, so storing a new one never
        evicts another of the same call: T5 runs exactly for :meth:`new` of them."""
        for t in texts:
            if t in self._held:
                self._held.move_to_end(t)
        out = []
        for t in texts:
            if t in self._held:
                self.hits += 1
            else:
                self.misses += 1
                self._held[t] = encode(t)
                while len(self._held) > max(self.keep, len(set(texts))):
                    self._held.popitem(last=False)
            out.append(self._held[t])
        return out


def encode_texts(parts, memo: TextContexts, device: torch.device, texts: Sequence[str], offload: bool) -> list:
    """Upstream's T5 encode of ``texts`` (speech2video L522-532), each taken from the group's
    ``memo`` when it was encoded before; T5 moves to the GPU only for a new one (``t5_cpu``: it
    encodes on the CPU, the contexts moved to ``device``); ``offload`` sends it back after;
    --release-encoders lets it go (the memo serves these texts again). One list of contexts per
    text, in order."""
    s2v = parts.shell
    new = memo.new(texts)
    with torch.no_grad():
        if not s2v.t5_cpu:
            if new:
                parts.text_encoder().model.to(device)
            out = memo.get_all(texts, lambda t: s2v.text_encoder([t], device))
            if new and offload:
                s2v.text_encoder.model.cpu()
        else:
            def on_cpu(t):
                return [c.to(device) for c in parts.text_encoder()([t], torch.device('cpu'))]
            out = memo.get_all(texts, on_cpu)
    if new:
        parts.release_text_encoder()
    return out


def audio_seconds(path: str) -> Optional[float]:
    """The speech's length in seconds from its header (None when it cannot be read)."""
    try:
        import soundfile
        return float(soundfile.info(path).duration)
    except Exception:  # noqa: BLE001 - a format soundfile does not read: librosa's reader
        try:
            import librosa
            return float(librosa.get_duration(path=path))
        except Exception:  # noqa: BLE001 - unknown: the rule keeps the CPU
            return None


def _free_bytes(device: torch.device) -> int:
    """What an allocation on ``device`` can get now: the driver's free memory plus the caching
    allocator's reserve that holds no tensor."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def placement(encoder, device: torch.device, audio_path: str) -> tuple[AudioEncoderDevice, str]:
    """(where, why) wav2vec2 runs this audio encode, by the shared rule on this moment's memory."""
    if device.type != "cuda":
        return encoder_placement.choose(device.type, None, 0)
    seconds = audio_seconds(audio_path)
    if seconds is None:
        return AudioEncoderDevice.CPU, "on the CPU, as upstream (the speech's length could not be read)"
    cfg = encoder.model.config
    need = encoder_placement.encode_bytes(_params(encoder.model), seconds, cfg.hidden_size,
                                          cfg.num_attention_heads, cfg.num_hidden_layers,
                                          windows=long_audio.windowable(cfg))
    return encoder_placement.choose("cuda", _free_bytes(device), need)


@contextlib.contextmanager
def audio_encoder_on(encoder, where: AudioEncoderDevice, device: torch.device) -> Iterator[None]:
    """Run the body with wav2vec2 where ``where`` says: on the GPU it is moved there (fp32, cuDNN's
    TF32 off, as the CPU computes) and back to the CPU after, whatever the body raised (upstream's
    ``extract_audio_feat`` sends its input to the model's device: a model left half on the GPU
    would fail every later job of a served group)."""
    if where is not AudioEncoderDevice.GPU:
        yield
        return
    try:
        encoder.model.to(device)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
            yield
    finally:
        encoder.model.to("cpu")


def encode_audio(s2v, where: AudioEncoderDevice, device: torch.device, audio_path: str, infer_frames: int):
    """Upstream's ``s2v.encode_audio`` (under ``no_grad``) with wav2vec2 where ``where`` says, and
    in windows where the speech is longer than one (:func:`long_audio.encode_audio`: shorter
    speech is that very call); when the GPU runs out of memory after all (another process took it
    since the rule looked), once more on the CPU, as upstream runs it. Returns what
    ``encode_audio`` returns."""
    seconds = audio_seconds(audio_path)
    try:
        with torch.no_grad(), audio_encoder_on(s2v.audio_encoder, where, device):
            return long_audio.encode_audio(s2v, audio_path, infer_frames, seconds)
    except torch.OutOfMemoryError:
        if where is not AudioEncoderDevice.GPU:
            raise
        log.warning("wav2vec2 ran out of GPU memory; encoding the speech on the CPU, as upstream")
        torch.cuda.empty_cache()
    with torch.no_grad():
        return long_audio.encode_audio(s2v, audio_path, infer_frames, seconds)
