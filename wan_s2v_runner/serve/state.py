"""The server's state (:class:`Server`: what every route reads) and the views of it the routes
return: a job as a video object, the server's state, the job fields with their defaults.

Routes (:mod:`.routes`) stay thin: they find the job, call one of these, and return the typed
model (:mod:`.protocol`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from wan_s2v_runner.serve.dirs import ServerDirs
from wan_s2v_runner.serve.keeper import Keeper
from wan_s2v_runner.serve.metrics import ServerMetrics
from wan_s2v_runner.serve.progress import GroupState
from wan_s2v_runner.serve.protocol import (
    Health,
    JobField,
    LayoutInfo,
    QueueHealth,
    RankInfo,
    ReplicaInfo,
    ServerState,
    VideoError,
    VideoObject,
)
from wan_s2v_runner.serve.retention import Retention
from wan_s2v_runner.serve.settings import ServerSettings
from wan_s2v_runner.serve.store.protocol import JobRow, JobStatus, JobStore
from wan_s2v_runner.serve.submissions import Policy, VideoJobFields, input_names, scrub
from wan_s2v_runner.serve.watch import Watch
from wan_s2v_runner.shared.events import share_done
from wan_s2v_runner.shared.media import FIRST_CLIP_DROPS, FPS
from wan_s2v_runner.shared.spec import JobSpec, flag_name

MODEL = "wan2.2-s2v-14b"
#: submissions checked at once (their inputs read and decoded, preflight): the rest wait their
#: turn, so a burst of submissions costs a bounded amount of memory and CPU
DECODE_SLOTS = 2


@dataclass
class Server:
    """Everything the routes use."""

    queue: JobStore
    keepers: list[Keeper]  # one per rank group (--replicas), each taking jobs from the queue
    dirs: ServerDirs
    base: dict[str, Any]  # every job's defaults (the command's job values, outputs left out)
    policy: Policy
    settings: ServerSettings
    watch: Watch  # what the server knows of its queue and shared directory between requests
    facts: Any = None  # the machine's facts, probed once (preflight of each job)
    metrics: Optional[ServerMetrics] = None
    retention: Retention = Retention()  # what is kept of ended jobs (--keep-videos, --keep-hours)
    identity: Optional[str] = None  # the digest of the fleet identity this server makes videos with
    decode_slots: int = DECODE_SLOTS  # submissions checked (media read and decoded) at once
    decoding: int = 0  # submissions being checked now
    decoding_peak: int = 0  # the most ever checked at once (/v1/server)
    sessions: Any = None  # the live sessions it holds (:class:`~.sessions.Sessions`; made when absent)

    def __post_init__(self):
        if self.sessions is None:
            from wan_s2v_runner.serve.sessions import Sessions
            self.sessions = Sessions(idle_s=self.settings.session_idle_s)
        self.sessions.rendered = self._rendered_s
        self.sessions.job_ended = self._job_ended

    def _job_ended(self, job_id: str) -> bool:
        try:
            row = self.queue.job_get(job_id)
        except Exception:  # noqa: BLE001 - the queue down: not known to have ended
            return False
        return row is None or row.status.terminal

    def _rendered_s(self, job_id: str) -> float:
        """Seconds of a live job's video made so far (its blocks done)."""
        from wan_s2v_runner.shared.speech_windows import BLOCK_SECONDS

        live = self.live(job_id) or {}
        return (live.get("blocks_done") or 0) * BLOCK_SECONDS

    @property
    def token(self) -> Optional[str]:
        return self.settings.token

    @property
    def roots(self) -> tuple[Path, ...]:
        """The server's own paths, never named in an error body (:func:`~.submissions.scrub`)."""
        spec = self.keepers[0].group_spec
        return (self.dirs.root, self.dirs.shared_root, *self.policy.allow_dirs, spec.ckpt_dir, spec.runs_root)

    @property
    def keeper(self) -> Keeper:
        """The first group's keeper: its spec is every group's layout (the groups differ only in
        what of the node they hold)."""
        return self.keepers[0]

    def live(self, job_id: str) -> Optional[dict[str, Any]]:
        """A running job's progress, from the group that makes it."""
        for k in self.keepers:
            live = k.live(job_id)
            if live is not None:
                return live
        return None

    def cancel_running(self, job_id: str) -> None:
        """Tell the group that makes ``job_id`` to stop it (at its next step)."""
        for k in self.keepers:
            k.cancel_running(job_id)


def percent(row: JobRow, live: Optional[dict]) -> int:
    """The share of the job done: a clip job's denoising steps, a live job's blocks (its unit)."""
    if row.status is JobStatus.COMPLETED:
        return 100
    share = share_done(live) if live else None
    return 0 if share is None else min(99, int(100 * share))


#: a video object's place in the queue, not given: the queue is asked
ASK = object()


def video_objects(server: Server, rows: list[JobRow]) -> list[VideoObject]:
    """Many rows' video objects, their places in the queue found in one query."""
    places = server.queue.job_positions([r.id for r in rows if r.status is JobStatus.QUEUED])
    return [video_object(server, r, position=places.get(r.id)) for r in rows]


def video_object(server: Server, row: JobRow, position: Any = ASK) -> VideoObject:
    if position is ASK:
        position = server.queue.job_positions([row.id]).get(row.id) if row.status is JobStatus.QUEUED else None
    # the progress its keeper here knows, else what the server running it stored (a shared queue)
    live = (server.live(row.id) or row.progress) if row.status is JobStatus.IN_PROGRESS else None
    record = row.record or {}
    spec = row.spec
    obj: dict[str, Any] = {
        "id": row.id, "model": MODEL, "status": row.status,
        "progress": percent(row, live), "created_at": int(row.created_at),
        "started_at": int(row.started_at) if row.started_at else None,
        "completed_at": int(row.finished_at) if row.finished_at and row.status is JobStatus.COMPLETED else None,
        "prompt": spec.get("prompt"), "seed": spec.get("seed"), "max_area": spec.get("max_area"),
        "queue_position": position if row.status is JobStatus.QUEUED else None,
        "stage_seconds": record.get("stage_seconds"), "wall_s": record.get("wall_s"),
        "resumed_at_clip": record.get("resumed_at_clip"), "attempts": row.attempt, "failures": row.failures,
        "cancel_requested": row.cancel_requested, "pool": row.pool, "identity": row.identity,
        "expires_at": server.retention.expires_at(row.finished_at) if row.status.terminal else None,
        "error": (VideoError(code=row.status.value, message=scrub(row.error, server.roots, input_names(spec)))
                  if row.status in (JobStatus.FAILED, JobStatus.CANCELLED) and row.error else None),
    }
    if live:
        obj.update(live)
    elif row.status in (JobStatus.CANCELLED, JobStatus.FAILED):  # what it made before it ended
        obj["preview_clips"] = record.get("preview_clips")
    if row.status in (JobStatus.COMPLETED, JobStatus.CANCELLED, JobStatus.FAILED):  # --cache: its record's
        obj["steps_reused"] = (record.get("step_cache") or {}).get("steps_reused")
    if row.status is JobStatus.COMPLETED:
        obj["live"] = record.get("live")
        obj["frames"] = record.get("frames")
        obj["sha256"] = (record.get("output") or {}).get("sha256")
    obj["seconds"], obj["size"] = _length_and_size(spec, record if row.status is JobStatus.COMPLETED else {})
    return VideoObject(**obj)


def _length_and_size(spec: dict[str, Any], record: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """The video's length (s) and WIDTHxHEIGHT: made (the record's frames), else asked (clips)."""
    fps = record.get("fps") or FPS
    frames = record.get("frames")
    if frames and len(frames) == 4:
        return f"{frames[1] / fps:g}", f"{frames[3]}x{frames[2]}"
    clips, per_clip = spec.get("num_clips"), spec.get("infer_frames")
    if clips and per_clip:
        return f"{(clips * per_clip - FIRST_CLIP_DROPS) / fps:g}", None
    return None, None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


#: each submission field's label in words (the status page's form; the flag name is its hint)
FIELD_LABELS = {
    "tts_text": "Text to speak", "tts_prompt_text": "What the voice sample says", "prompt": "Prompt",
    "negative_prompt": "Negative prompt", "max_area": "Size (area in pixels)", "infer_frames": "Frames per clip",
    "num_clips": "Clips", "steps": "Sampling steps", "shift": "Noise schedule shift",
    "guide_scale": "Guidance scale", "solver": "Sampler", "seed": "Seed",
    "start_from_ref": "Start from the reference image", "cache": "Step caching",
}


def job_fields(server: Server) -> list[JobField]:
    """The submission fields, in the spec's order, with their label, flag, type, limits, choices,
    description and the server's default (what a job gets when it leaves the field out)."""
    schema = VideoJobFields.model_json_schema()
    defs = schema.get("$defs", {})
    out = []
    for name, prop in schema["properties"].items():
        kinds = [k for k in prop.get("anyOf", [prop]) if k.get("type") != "null"]
        kind = kinds[0] if kinds else {}
        if "$ref" in kind:
            kind = defs.get(kind["$ref"].rsplit("/", 1)[-1], {})
        # what a job that leaves the field out gets: the server's flag, else the spec's own default
        info = JobSpec.model_fields[name]
        default = server.base[name] if name in server.base else (None if info.is_required() else info.default)
        out.append(JobField(name=name, label=FIELD_LABELS.get(name, name.replace("_", " ").capitalize()),
                            flag=flag_name(name), type=kind.get("type", "string"), enum=kind.get("enum"),
                            minimum=kind.get("minimum", kind.get("exclusiveMinimum")),
                            maximum=kind.get("maximum"), description=prop.get("description", ""),
                            default=_jsonable(getattr(default, "value", default))))
    return out


#: the server's state from its groups' (--replicas): the first of these any group is in
STATE_ORDER = (GroupState.WORKING, GroupState.IDLE, GroupState.LOADING, GroupState.RESTARTING, GroupState.STOPPED)


def replica_info(k: Keeper) -> ReplicaInfo:
    return ReplicaInfo(index=k.index, holds=k.holds, group=k.state.value, restarts=k.restarts, groups=k.groups,
                       current=k.current, last_error=k.last_error,
                       ranks=[RankInfo(**r, group=k.index) for r in k.ranks])


def queue_health(server: Server) -> QueueHealth:
    """What the watch last learned of the queue and the shared directory."""
    seen = server.watch.seen
    return QueueHealth(up=seen.queue_error is None, error=seen.queue_error, down_since=seen.queue_down_since,
                       store=server.queue.store_describe(), shared=server.queue.shared, pool=server.queue.pool,
                       identity=server.identity, shared_dir=str(server.dirs.shared_root),
                       shared_dir_problem=seen.dir_problem)


def server_state(server: Server, counts: Optional[dict[str, int]] = None) -> ServerState:
    """What the status page shows of the server (changes as the groups work); ``counts``: the
    jobs by status, when the caller has them. With several groups the top-level fields sum them
    (the state: the first of :data:`STATE_ORDER` any is in) and ``replicas`` has each."""
    k, spec = server.keeper, server.keeper.group_spec
    layout = spec.layout
    counts = counts if counts is not None else server.queue.job_counts()
    replicas = [replica_info(keeper) for keeper in server.keepers]
    states = {keeper.state for keeper in server.keepers}
    return ServerState(
        model=MODEL, group=next(s for s in STATE_ORDER if s in states).value,
        restarts=sum(r.restarts for r in replicas), groups=sum(r.groups for r in replicas),
        current=next((r.current for r in replicas if r.current), None),
        last_error=next((r.last_error for r in replicas if r.last_error), None),
        uptime_s=round(time.time() - k.started_at, 1), queue=counts,
        ranks=[rank for r in replicas for rank in r.ranks], replicas=replicas,
        layout=LayoutInfo(mode=spec.mode.value, world_size=spec.world_size, nnodes=spec.nnodes, nproc=spec.nproc,
                          cfg_degree=layout.cfg_degree, sp_degree=layout.sp_degree,
                          vae_parallel=layout.vae_parallel, device=spec.device,
                          attention=getattr(spec.attention, "value", spec.attention)),
        loras=[str(lora) for lora in spec.lora], queue_state=queue_health(server))


def health(server: Server) -> Health:
    """``/health``: what the groups do and what the watch last learned; never asks the queue (it
    answers at once while the database is down, and says so)."""
    seen = server.watch.seen
    counts = seen.counts if seen.counts is not None else {s.value: 0 for s in JobStatus}
    state = server_state(server, counts=counts)
    return Health(status="ok" if server.watch.not_ready() is None else "degraded",
                  group=state.group, restarts=state.restarts, groups=state.groups, current=state.current,
                  last_error=state.last_error, queue=state.queue, uptime_s=state.uptime_s, model=state.model,
                  replicas=[r.model_copy(update={"ranks": []}) for r in state.replicas],
                  mode=state.layout.mode, world_size=state.layout.world_size,
                  cfg_parallel=state.layout.cfg_degree == 2, device=state.layout.device,
                  queue_state=state.queue_state.model_copy(update={"store": None, "shared_dir": None}))
