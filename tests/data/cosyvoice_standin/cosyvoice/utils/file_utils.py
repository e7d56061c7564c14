"""Stand-in of cosyvoice.utils.file_utils (tests only)."""
import librosa
import torch


def load_wav(wav, target_sr):
    """The prompt as a [1, T] float tensor at target_sr (CosyVoice refuses a lower rate)."""
    native = librosa.get_samplerate(wav)
    assert native >= target_sr, f"wav sample rate {native} must be greater than {target_sr}"
    speech, _ = librosa.load(wav, sr=target_sr, mono=True)
    return torch.from_numpy(speech).unsqueeze(0)
