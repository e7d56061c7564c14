"""Patch: import wan/modules/t5.py without touching CUDA.

Upstream: ``T5EncoderModel.__init__`` has the default argument
``device=torch.cuda.current_device()``, evaluated when the module is imported. Without CUDA it
raises (AssertionError / "Torch not compiled with CUDA enabled"), so ``import wan`` fails; with
CUDA it initialises CUDA in the importing process, and a process that has done so cannot fork
ranks that use CUDA ("Cannot re-initialize CUDA in forked subprocess"): the node's agent imports
the engine and then forks the ranks (:mod:`wan_s2v_runner.rank.agent`).
Change: only while ``import wan`` runs, make ``torch.cuda.current_device`` return 0, what it
returns in a process that has not chosen a device (that default is never used by the S2V path,
which passes ``device=torch.device('cpu')``: speech2video.py and loading/components.py); the real
function is restored right after.
Proof: tests/test_patches.py imports wan in a fresh CPU process and checks the function is
restored and CUDA untouched (``torch.cuda.is_initialized()`` still False).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def applied() -> Iterator[bool]:
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield True
    finally:
        torch.cuda.current_device = original
