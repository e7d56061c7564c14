"""Peak memory per stage (rank/memory_peaks.py): a stage's peak is its own, the run's is kept.

In this process, on the real kernel counter (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``): a stage that held 256 MiB for a moment reports it, the next stage does
not, and the whole-run figure still has it, although the kernel's own
counter (and ``getrusage``) forgot it at the reset. The spawned-run side (one ``stage_peak``
record per stage, in ``run.json``) is asserted in ``test_supervision``.
"""
from __future__ import annotations

import resource
import sys

import pytest
import torch

from wan_s2v_runner.rank.memory_peaks import StagePeaks
from wan_s2v_runner.shared.procfs import hwm_mb

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")


@linux_only
def test_a_stage_peak_is_its_own_and_the_run_keeps_the_largest():
    peaks = StagePeaks()
    base = peaks.take()["host_peak_rss_mb"]  # a stage starts (its mark: the RSS now)
    big = torch.ones(64 * 2**20, dtype=torch.int32)  # 256 MiB, every page written
    del big  # given back before the stage ends
    held = peaks.take()["host_peak_rss_mb"]  # that stage ends; the next one starts
    after = peaks.take()["host_peak_rss_mb"]  # the next stage, which allocated nothing
    assert held >= base + 240, (base, held)
    assert after < held - 200, (held, after)  # reset: the freed 256 MiB is not this stage's
    assert hwm_mb() < held - 200 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 < held - 200
    run = peaks.run_peaks()
    assert run["host_peak_rss_mb"] >= held and run["gpu_peak_allocated_mb"] is None
