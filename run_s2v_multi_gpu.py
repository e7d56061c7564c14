#!/usr/bin/env python
"""Run Wan2.2 S2V-14B on one or many GPUs: the same flags as ``wan-s2v run``.

    python run_s2v_multi_gpu.py --mode ulysses --nproc 8 --ckpt-dir Wan2.2-S2V-14B \
        --image ref.png --audio speech.wav --prompt "..." --output out.mp4
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wan_s2v_runner.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
