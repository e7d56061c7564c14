"""A live session's block latencies: the seconds from the arrival of the last sample of speech a
block needed to its fragment in the video file (where a stream or a viewer takes it). Counted by the
decoding rank's video writer (the job's record) and by the server from its events (the video
object, ``/metrics``), with one rule for the percentiles."""
from __future__ import annotations

from typing import Optional


class Latencies:
    """Block latencies: their count, percentiles over a bounded sample (the newest :attr:`keep`: an
    hour's session makes 4800 blocks), the largest."""

    def __init__(self, keep: int = 4096):
        self.keep = keep
        self.kept: list[float] = []
        self.count = 0
        self.most = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.most = max(self.most, seconds)
        self.kept.append(seconds)
        if len(self.kept) > self.keep:
            del self.kept[:len(self.kept) - self.keep]

    def percentile(self, p: float) -> Optional[float]:
        """The ``p`` quantile (0..1) of the kept latencies, nearest rank (None: none yet)."""
        if not self.kept:
            return None
        ordered = sorted(self.kept)
        return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]

    def summary(self) -> dict:
        """``{"block_latency_s": {p50, p95, max, blocks}}`` ({} before any block)."""
        if not self.count:
            return {}
        return {"block_latency_s": {"p50": self.percentile(0.5), "p95": self.percentile(0.95),
                                    "max": round(self.most, 4), "blocks": self.count}}
