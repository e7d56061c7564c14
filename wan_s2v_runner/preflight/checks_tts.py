"""Group ``inputs``, check ``inputs.tts``: ``--tts-text`` can be spoken without a download.

Upstream's ``WanS2V.tts`` clones the CosyVoice repository and downloads CosyVoice2-0.5B into
the working directory when they are absent. Here the user names both (``--cosyvoice-dir``,
``--cosyvoice-model``; defaults under the checkpoint directory) and this check proves, before
any rank exists: the code checkout is there and ``from cosyvoice.cli.cosyvoice import
CosyVoice2`` imports with it on the path (in a child interpreter: the launcher stays free of
torch), the model directory has CosyVoice2's files, and the voice prompt decodes at 16 kHz or
more (CosyVoice's ``load_wav`` refuses less), ideally 5-15 s long (upstream's advice).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from wan_s2v_runner.shared.cosyvoice import MODEL_FILES, code_paths

from .core import fail, ok, skip, warn

IMPORT_TIMEOUT_S = 300.0


def import_cosyvoice(code_dir: Path, timeout: float = IMPORT_TIMEOUT_S) -> str:
    """'' when CosyVoice2 imports from ``code_dir`` in a child interpreter, else its last error line."""
    code = ("import sys; sys.path[:0] = sys.argv[1:]; "
            "from cosyvoice.cli.cosyvoice import CosyVoice2; from cosyvoice.utils.file_utils import load_wav")
    try:
        p = subprocess.run([sys.executable, "-c", code, *code_paths(code_dir)], capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"the import took over {timeout:g} s"
    if p.returncode == 0:
        return ""
    lines = [line for line in (p.stderr or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {p.returncode}"


def check_tts(ctx):
    spec = ctx.spec
    if not getattr(spec, "tts_text", None):
        return skip("inputs.tts", "no --tts-text")
    if spec.ckpt_dir is None:
        return skip("inputs.tts", "needs --ckpt-dir (the CosyVoice defaults lie under it)")
    code_dir, model_dir = spec.cosyvoice_paths
    fetch = ("git clone https://github.com/FunAudioLLM/CosyVoice {d} (with its submodules) and install its "
             "requirements")
    if not (code_dir / "cosyvoice" / "cli" / "cosyvoice.py").is_file():
        return fail("inputs.tts", f"no CosyVoice code at {code_dir} (cosyvoice/cli/cosyvoice.py)",
                    fetch.format(d=code_dir) + ", or point --cosyvoice-dir at your checkout")
    missing = [f for f in MODEL_FILES if not (model_dir / f).is_file()]
    if missing:
        return fail("inputs.tts", f"the CosyVoice2 model directory {model_dir} lacks {', '.join(missing)}",
                    f"huggingface-cli download FunAudioLLM/CosyVoice2-0.5B --local-dir {model_dir}, or point "
                    "--cosyvoice-model at it")
    err = import_cosyvoice(code_dir)
    if err:
        return fail("inputs.tts", f"CosyVoice2 does not import from {code_dir}: {err}",
                    "install CosyVoice's requirements in this environment (pip install -r "
                    f"{code_dir / 'requirements.txt'})")
    prompt = spec.tts_prompt_audio
    if not prompt.is_file():
        return fail("inputs.tts", f"--tts-prompt-audio {prompt} does not exist", "pass the voice prompt (wav)")
    from .checks_inputs import decode_audio
    try:
        n, sr, _, bad = decode_audio(prompt)
    except Exception as e:  # noqa: BLE001
        return fail("inputs.tts", f"--tts-prompt-audio {prompt.name} does not decode as audio ({e})",
                    "convert it: ffmpeg -i IN -ac 1 -ar 16000 prompt.wav")
    secs = n / sr if sr else 0.0
    if sr < 16000 or bad or n == 0:
        why = f"{sr} Hz (CosyVoice needs 16 kHz or more)" if sr < 16000 else "NaN/infinite or no samples"
        return fail("inputs.tts", f"--tts-prompt-audio {prompt.name}: {why}",
                    "record or export the prompt at 16 kHz or more: ffmpeg -i IN -ar 16000 prompt.wav")
    finding = (f"CosyVoice2 from {code_dir} with {model_dir.name}; voice prompt {secs:.1f} s at {sr} Hz, "
               + ("zero-shot (with its transcript)" if spec.tts_prompt_text else "cross-lingual (no transcript)"))
    if not 5.0 <= secs <= 15.0:
        return warn("inputs.tts", finding + ": upstream advises a 5-15 s prompt", "trim or extend the voice prompt")
    return ok("inputs.tts", finding)
