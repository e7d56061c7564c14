"""``GET /metrics``: the server in the Prometheus text format, written by ``prometheus_client``.

Each server has its own registry (no process-wide state). What is counted as it happens lives in
the library's own types: the job and stage seconds histograms (observed when a job completes, and
at start-up for the jobs the queue already holds as completed, so a restart keeps them). What is
a state is read at scrape time by a collector: whether the queue answers and the shared directory
passes its check, jobs by status and the queue's length (while the queue is down, as the server's
watch last read them: a scrape never waits on a database known to be away), finished jobs,
rank-group restarts, the running job's denoising speed, each rank's memory and the group's state.

=============================================  =========  ======================================
name                                           type       labels
=============================================  =========  ======================================
``wan_s2v_queue_up``                           gauge      (1 while the queue answers)
``wan_s2v_shared_dir_ok``                      gauge      (1 while the shared directory passes its check)
``wan_s2v_jobs``                               gauge      ``status``
``wan_s2v_queue_length``                       gauge
``wan_s2v_jobs_finished_total``                counter    ``status`` (completed, failed, cancelled)
``wan_s2v_job_seconds``                        histogram  (taken -> mp4 written)
``wan_s2v_stage_seconds``                      histogram  ``stage``
``wan_s2v_denoise_steps_per_second``           gauge      (running job, else the last completed)
``wan_s2v_rank_group_restarts_total``          counter
``wan_s2v_rank_group_state``                   gauge      ``state`` (1 for the current one)
``wan_s2v_rank_rss_bytes``                     gauge      ``rank``
``wan_s2v_rank_gpu_peak_allocated_bytes``      gauge      ``rank`` (GPU runs)
=============================================  =========  ======================================

Steps a second count from a job's first denoising step, its decodes between clips included.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from wan_s2v_runner.serve.store.protocol import JobStatus, JobStore, QueueUnavailable

#: job seconds: a tiny CPU job takes seconds, a 40-step 720p job on one GPU an hour
JOB_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, float("inf"))
STAGE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, float("inf"))
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StateCollector:
    """What the queue and the keepers say at scrape time."""

    def __init__(self, metrics: "ServerMetrics"):
        self.m = metrics

    def collect(self):
        seen = self.m.watch.seen
        yield GaugeMetricFamily("wan_s2v_queue_up", "1 while the queue answers", value=int(seen.queue_error is None))
        yield GaugeMetricFamily("wan_s2v_shared_dir_ok", "1 while the shared directory passes its check",
                                value=int(seen.dir_problem is None))
        counts = seen.counts or {}
        if seen.queue_error is None:  # up: now's counts (while it is down, the last the watch read)
            try:
                counts = self.m.queue.job_counts()
            except QueueUnavailable:
                pass
        jobs = GaugeMetricFamily("wan_s2v_jobs", "jobs on this server by status", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        yield jobs
        yield GaugeMetricFamily("wan_s2v_queue_length", "jobs waiting to be taken",
                                value=counts.get(JobStatus.QUEUED.value, 0))
        finished = CounterMetricFamily("wan_s2v_jobs_finished", "jobs that ended, by how", labels=["status"])
        for status in JobStatus:
            if status.terminal:
                finished.add_metric([status.value], counts.get(status.value, 0))
        yield finished
        keepers = self.m.keepers
        restarts = CounterMetricFamily("wan_s2v_rank_group_restarts", "rank groups started again after one ended",
                                       labels=["group"])
        state = GaugeMetricFamily("wan_s2v_rank_group_state", "each rank group's state (1: current)",
                                  labels=["group", "state"])
        speed = GaugeMetricFamily("wan_s2v_denoise_steps_per_second",
                                  "denoising steps a second since the job's first step, its decodes included "
                                  "(the running job, else the last completed), per rank group", labels=["group"])
        latency = GaugeMetricFamily("wan_s2v_session_block_latency_seconds",
                                    "a running live session's block latency (arrival of its last needed speech to "
                                    "its fragment in the video), by quantile", labels=["group", "quantile"])
        for k in self.m.keepers:
            live = (k.live(k.current) or {}).get("live") if k.current else None
            figures = (live or {}).get("block_latency_s")
            if figures:
                for q in ("p50", "p95", "max"):
                    latency.add_metric([str(k.index), q], figures[q])
        yield latency
        rss = GaugeMetricFamily("wan_s2v_rank_rss_bytes", "each rank's resident host memory", labels=["group", "rank"])
        gpu = GaugeMetricFamily("wan_s2v_rank_gpu_peak_allocated_bytes", "each rank's peak GPU memory allocated",
                                labels=["group", "rank"])
        for keeper in keepers:
            group = str(keeper.index)
            restarts.add_metric([group], keeper.restarts)
            for s in type(keeper.state):
                state.add_metric([group, s.value], 1 if s is keeper.state else 0)
            steps = keeper.steps_per_s()
            if steps is not None:
                speed.add_metric([group], steps)
            for r in keeper.ranks:
                if r.get("rss_mb") is not None:
                    rss.add_metric([group, str(r["rank"])], r["rss_mb"] * 2**20)
                if r.get("gpu_peak_allocated_mb") is not None:
                    gpu.add_metric([group, str(r["rank"])], r["gpu_peak_allocated_mb"] * 2**20)
        yield restarts
        yield state
        yield speed
        yield rss
        yield gpu


class ServerMetrics:
    """One server's metrics; :meth:`job_completed` is the keeper's ``on_completed``."""

    def __init__(self, queue: JobStore, watch):
        self.queue, self.watch, self.keepers = queue, watch, []
        self.registry = CollectorRegistry(auto_describe=True)
        self.job_seconds = Histogram("wan_s2v_job_seconds", "a completed job's seconds, taken to mp4 written",
                                     buckets=JOB_BUCKETS, registry=self.registry)
        self.stage_seconds = Histogram("wan_s2v_stage_seconds", "a completed job's seconds in each stage",
                                       ["stage"], buckets=STAGE_BUCKETS, registry=self.registry)
        try:
            rows = queue.job_list(limit=100_000)
        except QueueUnavailable:
            rows = []
        for row in rows:
            if row.status is JobStatus.COMPLETED and row.record:
                self.job_completed(row.record)

    def attach(self, keepers: list) -> None:
        """The keepers whose groups' state and ranks the scrape reads (it starts the collector)."""
        self.keepers = list(keepers)
        self.registry.register(_StateCollector(self))

    def job_completed(self, record: dict[str, Any]) -> None:
        if isinstance(record.get("wall_s"), (int, float)):
            self.job_seconds.observe(float(record["wall_s"]))
        for stage, secs in (record.get("stage_seconds") or {}).items():
            if isinstance(secs, (int, float)):
                self.stage_seconds.labels(stage=stage).observe(float(secs))

    def text(self) -> bytes:
        return generate_latest(self.registry)
