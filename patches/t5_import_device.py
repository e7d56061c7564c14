"""Patch: import wan/modules/t5.py on a machine without CUDA.

Upstream: ``T5EncoderModel.__init__`` has the default argument
``device=torch.cuda.current_device()``, evaluated when the module is imported; without CUDA it
raises (AssertionError / "Torch not compiled with CUDA enabled"), so ``import wan`` fails.
Change: only while ``import wan`` runs, and only when CUDA is unavailable, make
``torch.cuda.current_device`` return 0 (that default is never used by the S2V path, which passes
``device=torch.device('cpu')``); the real function is restored right after.
Proof: tests/test_patches.py imports wan in a fresh CPU process and checks the function is restored.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def applied() -> Iterator[bool]:
    if torch.cuda.is_available():
        yield False
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield True
    finally:
        torch.cuda.current_device = original
