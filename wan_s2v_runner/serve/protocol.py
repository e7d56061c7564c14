"""What the HTTP API answers, as typed models (so ``/docs`` and ``/openapi.json`` show them).

The shapes follow OpenAI's video API as vLLM-Omni and FastVideo serve it: a video object
(``object: "video"``, ``status``, ``progress``, ``created_at``, ``completed_at``, ``error``), a
list (``object: "list"``, ``data``) and an error body (``{"error": {"message", "type", "param",
"code"}}``), plus what ours adds (the stage, clip and step (a live job: its block), the ETA, seconds
per stage, the place in the queue, clips (blocks) done of the clips (blocks) in all) and the
server's own state (``/health``, ``/v1/server``). Requests are :mod:`.submissions`' (a job's fields:
:data:`~.submissions.VideoJobFields`).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from wan_s2v_runner.serve.store.protocol import JobStatus


class ErrorDetail(BaseModel):
    message: str = Field(description="the cause and the fix, one line")
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, ...")
    param: Optional[str] = Field(None, description="the field the error is about")
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every refusal (4xx)."""

    error: ErrorDetail


class VideoError(BaseModel):
    code: str = Field(description="failed or cancelled")
    message: str


class BlockLatency(BaseModel):
    """A live session's block latencies: seconds from the arrival of the last sample of speech a block
    needed to its fragment in the video (where its stream and viewers take it)."""

    p50: float
    p95: float
    max: float
    blocks: int


class LiveFigures(BaseModel):
    """A live job's figures (``--mode live``): its pace against real time and, a session's, its latency."""

    first_frame_s: Optional[float] = Field(None, description="seconds from the job's start on its group to its "
                                                             "first frame")
    fps: Optional[float] = Field(None, description="frames a second made since the first (16: real time)")
    frames_made: Optional[int] = None
    blocks: Optional[int] = None
    block_latency_s: Optional[BlockLatency] = None


class VideoObject(BaseModel):
    """A job, as OpenAI's video object, with our progress fields."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus
    progress: int = Field(ge=0, le=100, description="percent of the job done: its denoising steps (a live job: its "
                                                    "blocks)")
    created_at: int
    started_at: Optional[int] = None
    completed_at: Optional[int] = None
    prompt: Optional[str] = None
    seed: Optional[int] = None
    max_area: Optional[int] = None
    queue_position: Optional[int] = Field(None, description="1-based place in the queue while queued")
    stage: Optional[str] = None
    unit: Optional[Literal["clip", "block"]] = Field(
        None, description="what the job's progress counts, while it runs: clip (a clip job: the clip and step fields) "
                          "or block (a live job, --mode live: the block fields; no steps); None before its first "
                          "clip or block begins")
    clip: Optional[int] = Field(None, description="the clip in progress, 1-based (a clip job; None for a live job)")
    clips: Optional[int] = Field(None, description="the clips in all (a clip job; None for a live job)")
    block: Optional[int] = Field(None, description="the block in progress, 1-based (a live job; None for a clip job)")
    blocks: Optional[int] = Field(None, description="the blocks in all (a live job; None for a clip job)")
    step: Optional[int] = Field(None, description="the denoising step of the clip in progress (a clip job)")
    steps: Optional[int] = Field(None, description="the denoising steps a clip has (a clip job)")
    clips_done: Optional[int] = Field(None, ge=0, description="clips of the video complete so far, while it runs "
                                                              "(None until the first clip begins; a live job: None)")
    clips_total: Optional[int] = Field(None, ge=1, description="clips the video has in all, while it runs (a live "
                                                               "job: None)")
    blocks_done: Optional[int] = Field(None, ge=0, description="a live job's blocks made so far, while it runs")
    blocks_total: Optional[int] = Field(None, ge=1, description="a live job's blocks in all, while it runs")
    eta_s: Optional[float] = Field(None, description="seconds left, while it runs: the clips (a live job: blocks) "
                                                     "left at the seconds one took so far (before the first ends, "
                                                     "the plan's estimate, else the first one's step pace); None "
                                                     "when unknown")
    stage_seconds: Optional[dict[str, float]] = None
    wall_s: Optional[float] = None
    resumed_at_clip: Optional[int] = None
    preview_clips: Optional[int] = Field(None, description="clips in the video so far, while it runs and after it "
                                                           "was cancelled or failed (GET .../content?variant=partial)")
    steps_reused: Optional[int] = Field(None, description="with a cache policy (the cache field): the denoising "
                                                          "steps that reused a computed step instead of running the "
                                                          "DiT, over the clips this attempt made (a resumed job: "
                                                          "the clips after the resume)")
    attempts: int = Field(0, description="rank groups handed this job (a resumed job: more than one)")
    failures: int = Field(0, description="rank groups that failed under this job")
    cancel_requested: bool = False
    pool: Optional[str] = Field(None, description="the pool of the fleet whose servers take it (--pool)")
    identity: Optional[str] = Field(None, description="the digest of the fleet identity (weights, engine, frame "
                                                      "settings) of the server that took it")
    error: Optional[VideoError] = None
    frames: Optional[list[int]] = Field(None, description="the video tensor's shape: channels, frames, height, width")
    sha256: Optional[str] = None
    seconds: Optional[str] = Field(None, description="the video's length, s (once known: the clips asked, or made)")
    size: Optional[str] = Field(None, description="WIDTHxHEIGHT of the video, once made (the image's aspect kept)")
    expires_at: Optional[int] = None
    remixed_from_video_id: Optional[str] = None
    live: Optional[LiveFigures] = Field(None, description="a live job's figures (--mode live): while it runs and "
                                                          "after it completed")


class SessionObject(BaseModel):
    """A live session (``/v1/videos/sessions``): its video job (``video``, the same object as
    ``GET /v1/videos/{id}``) and the session's own state."""

    id: str
    object: Literal["video.session"] = "video.session"
    state: Literal["open", "ending", "ended"] = Field(
        description="open: speech may be appended; ending: ended by its client (or idle), the speech placed is being "
                    "rendered; ended: its video job ended (completed: its recording is GET /v1/videos/{id}/content)")
    ended_by: Optional[Literal["client", "idle"]] = None
    pace: Literal["realtime", "speech"] = Field(
        description="realtime: blocks at their time, silent (the avatar listens) where no speech arrived; speech: "
                    "blocks as the speech arrives, never silent by the clock (rendering a stream offline)")
    speech_s: float = Field(description="seconds of speech appended so far")
    interrupts: int = 0
    stream_url: str = Field(description="GET: the session's video as one fragmented MP4 (H.264 and AAC) over HTTP, "
                                        "from its first fragment, each block as it is made, until the session "
                                        "ends (MSE-playable)")
    speech_url: str = Field(description="POST: speech to append (body: format=s16le|f32le raw PCM at rate=HZ, or a "
                                        "WAV/FLAC/OGG file with format=wav)")
    whep_url: str = Field(description="POST an SDP offer (application/sdp, WHEP): the session's video and the speech "
                                      "it plays as WebRTC tracks, from its newest block, at real time; 201: the SDP "
                                      "answer and Location, the viewer (DELETE it to stop)")
    video: VideoObject


class VideoList(BaseModel):
    """A page of videos, as OpenAI's cursor pages: the next one is ``?after=LAST_ID``."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    has_more: bool = False
    first_id: Optional[str] = None
    last_id: Optional[str] = None


class VideoDeleted(BaseModel):
    """``DELETE /v1/videos/{id}``: the video, its files and its record are gone."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class RankInfo(BaseModel):
    rank: int
    stage: str
    group: int = Field(0, description="which of the server's rank groups (--replicas) it belongs to")
    host: Optional[str] = None
    rss_mb: Optional[float] = None
    host_peak_rss_mb: Optional[float] = None
    gpu_peak_allocated_mb: Optional[float] = None
    gpu_peak_reserved_mb: Optional[float] = None


class LayoutInfo(BaseModel):
    mode: str
    world_size: int
    nnodes: int
    nproc: int
    cfg_degree: int
    sp_degree: int
    vae_parallel: bool
    device: str
    attention: str


class ReplicaInfo(BaseModel):
    """One of the server's rank groups (``--replicas``; one group: the only one)."""

    index: int
    holds: str = Field(description="what of the node it runs on (its GPUs, or its CPUs)")
    group: str = Field(description="loading, idle, working, restarting or stopped")
    restarts: int
    groups: int = Field(description="rank groups it started")
    current: Optional[str] = Field(None, description="the job it is making")
    last_error: Optional[str] = None
    ranks: list[RankInfo] = Field(default_factory=list)


class QueueHealth(BaseModel):
    """The server's queue and shared directory, as its watch last saw them."""

    up: bool = Field(description="the queue answered the last time it was asked")
    error: Optional[str] = Field(None, description="why it does not, while it does not")
    down_since: Optional[float] = Field(None, description="since when it does not answer (Unix time)")
    store: Optional[str] = Field(None, description="the queue: a SQLite file, or a postgresql:// URL without its "
                                                   "password (not in /health)")
    shared: bool = Field(description="other servers share the queue")
    pool: str = Field(description="the pool of the fleet this server takes jobs from (--pool)")
    identity: Optional[str] = Field(None, description="the digest of this server's fleet identity")
    shared_dir: Optional[str] = Field(None, description="where uploads, videos and clip checkpoints go (not in "
                                                        "/health)")
    shared_dir_problem: Optional[str] = Field(None, description="why the shared directory is not usable now "
                                                                "(the server takes no job meanwhile)")


class ServerState(BaseModel):
    """What the status page shows of the server and its rank group."""

    model: str
    group: str = Field(description="loading, idle, working, restarting or stopped")
    restarts: int
    groups: int
    current: Optional[str] = Field(None, description="the job the group is making")
    last_error: Optional[str] = None
    uptime_s: float
    queue: dict[str, int] = Field(description="jobs by status")
    ranks: list[RankInfo]
    replicas: list[ReplicaInfo] = Field(default_factory=list, description="each rank group (--replicas)")
    layout: LayoutInfo
    loras: list[str]
    queue_state: Optional[QueueHealth] = None


class JobField(BaseModel):
    """A field a submission may set, with the server's default (the page's form)."""

    name: str
    label: str = Field(description="the field in words")
    flag: str = Field(description="the same setting's command-line flag")
    type: str
    enum: Optional[list[Any]] = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    description: str = ""
    default: Any = None


class ServerInfo(ServerState):
    fields: list[JobField]
    auth: bool
    max_upload_mb: int
    decode_slots: int = Field(description="submissions checked at once; the rest wait their turn")
    decoding_peak: int = Field(description="the most submissions ever checked at once")
    followers: int = Field(description="event streams open now (status pages and job followers)")
    feed_reads: int = Field(description="reads of the queue by the live feed so far (one per tick, shared by "
                                        "every event stream)")


class Health(BaseModel):
    """``/health`` (no token): the server and its group, without hosts, LoRAs or prompts; what it
    last learned of its queue and shared directory (``degraded`` while either fails)."""

    status: Literal["ok", "degraded"] = "ok"
    group: str
    restarts: int
    groups: int
    current: Optional[str] = None
    last_error: Optional[str] = None
    queue: dict[str, int]
    uptime_s: float
    model: str
    mode: str
    world_size: int
    cfg_parallel: bool
    device: str
    replicas: list[ReplicaInfo] = Field(default_factory=list, description="each rank group (without its ranks)")
    queue_state: Optional[QueueHealth] = None


class Snapshot(BaseModel):
    """``/v1/events``' first event (``snapshot``): the server and the newest jobs, oldest first."""

    server: ServerState
    videos: list[VideoObject]


class FeedChanges(BaseModel):
    """``/v1/events``' later events (``changes``): only what changed since the last event."""

    server: Optional[ServerState] = Field(None, description="the server's state, when it changed")
    videos: list[VideoObject] = Field(description="the videos that changed")
    gone: list[str] = Field(description="ids no longer among the newest jobs (deleted, or older than the newest "
                                        "100)")
