"""Peak memory per stage on a rank: the GPU allocator's peak and the host's resident-set peak.

Each stage change takes the peaks since the last one and resets them, so a run's ``run.json``
says which stage held the most (``stage_peak_mb``: what the memory plan's phases are checked
against, docs/memory-plan.md). GPU: ``torch.cuda.max_memory_allocated`` / ``_reserved``, reset
with ``torch.cuda.reset_peak_memory_stats``. Host (Linux): the kernel's high-water mark
``VmHWM`` of ``/proc/self/status``, reset to the current RSS by writing ``5`` to
``/proc/self/clear_refs`` (proc(5)); elsewhere, or where that file is not writable, no host
figure per stage. A reset lowers what ``getrusage`` and torch report from then on, so the
whole-run peaks are the maxima kept here (:meth:`StagePeaks.run_peaks`).
"""
from __future__ import annotations

import resource
import threading
from pathlib import Path
from typing import Optional

import torch

from wan_s2v_runner.shared.procfs import hwm_mb

_CLEAR_REFS = Path("/proc/self/clear_refs")
MiB = 2**20


def reset_host_hwm() -> bool:
    """Set the high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class StagePeaks:
    """This rank's peaks: per stage (:meth:`take`) and over the whole run (:meth:`run_peaks`)."""

    def __init__(self, cuda_device: Optional[int] = None):
        """``cuda_device``: the rank's GPU index (its counters are read by index: the heartbeat
        thread's current device is not the rank's); None on a CPU rank."""
        self.cuda_device = cuda_device
        self._lock = threading.Lock()  # the heartbeat thread reads run_peaks while a stage takes
        before = hwm_mb()  # the process so far: kept, the first reset must not lose it
        self._host_resettable = before is not None and reset_host_hwm()
        self._run = {"host_peak_rss_mb": before or 0.0, "gpu_peak_allocated_mb": 0.0, "gpu_peak_reserved_mb": 0.0}

    def _gpu_now(self) -> dict:
        if self.cuda_device is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {}
        return {"gpu_peak_allocated_mb": round(torch.cuda.max_memory_allocated(self.cuda_device) / MiB, 1),
                "gpu_peak_reserved_mb": round(torch.cuda.max_memory_reserved(self.cuda_device) / MiB, 1)}

    def _host_now(self) -> dict:
        hwm = hwm_mb() if self._host_resettable else None
        return {"host_peak_rss_mb": hwm} if hwm is not None else {}

    def take(self) -> dict:
        """The peaks since the last call (the stage that is ending), then reset: MiB by name."""
        with self._lock:
            got = {**self._host_now(), **self._gpu_now()}
            for k, v in got.items():
                self._run[k] = max(self._run[k], v)
            if self._host_resettable:
                reset_host_hwm()
            if "gpu_peak_allocated_mb" in got:
                torch.cuda.reset_peak_memory_stats(self.cuda_device)
            return got

    def run_peaks(self) -> dict:
        """Whole-run peaks so far (MiB): the kept maxima and what the counters say now; GPU
        figures None on a rank that has not used CUDA."""
        with self._lock:
            host_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            out = {"host_peak_rss_mb": round(max(self._run["host_peak_rss_mb"], host_now, hwm_mb() or 0), 1)}
            gpu = self._gpu_now()
            if gpu:
                out.update({k: round(max(self._run[k], v), 1) for k, v in gpu.items()})
            else:
                out.update(gpu_peak_allocated_mb=None, gpu_peak_reserved_mb=None)
            return out
