"""``wan-s2v submit`` and ``wan-s2v jobs``: a terminal client of a ``wan-s2v serve`` server.

``submit`` sends one job (its flags are the job's own fields, generated from the run spec like
every command's; ``--image``/``--audio`` are uploaded, or sent as server paths with
``--server-paths``), follows its progress from the server's ``/v1/videos/{id}/events`` stream
(a live rich view on a terminal, plain lines otherwise), and downloads the mp4 to ``--output``
(default ``ID.mp4`` in the current directory, or in ``--output`` when that is a directory; temp
name, then rename). ``jobs`` lists the
server's jobs, shows the ones named, or cancels them (``--cancel``). ``--json`` prints the video
object(s) instead. The server comes from ``--url`` / ``$WAN_S2V_URL``, the token from
``--token-file``, ``--token`` or ``$WAN_S2V_TOKEN`` (:mod:`.serve.bearer`).

``submit`` sends its job with an ``Idempotency-Key`` of its own and, while the server cannot
take it (no answer, or 503: its queue's database away, its shared directory failing), sends the
same request again for up to :data:`RECONNECT_S` (after the server's ``Retry-After``): the job is
made once, however many tries it took.

Exit codes (README): 0 done; 3 the server refused the request (a 4xx: its cause printed; for
``submit``, nothing was queued); 6 the job failed or was cancelled on the server; 7 the server
could not be reached (for ``submit``: for :data:`RECONNECT_S` while submitting or following),
answered a server error, or the finished video could not be downloaded or written; 130
interrupted (the job goes on on the server: ``wan-s2v jobs ID`` finds it).
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Optional

import httpx

from wan_s2v_runner.launcher.console import PROGRESS_EVERY_S, fmt_seconds
from wan_s2v_runner.launcher.flags import flag_values
from wan_s2v_runner.serve.bearer import TokenError, token_of
from wan_s2v_runner.serve.store.protocol import JobStatus
from wan_s2v_runner.shared import atomic, exit_codes
from wan_s2v_runner.shared.events import ProgressUnit, position
from wan_s2v_runner.shared.jobs import INPUT_FIELDS

URL_ENV = "WAN_S2V_URL"
DEFAULT_URL = "http://127.0.0.1:8000"
#: a silent server this long is a dead one (its event streams send a ping every 15 s)
READ_TIMEOUT_S = 90
#: how long ``submit`` keeps trying to reach a server that went away while it follows a job
RECONNECT_S = 300


class ClientError(Exception):
    """A request that did not do what was asked: the exit code and one line to print."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def connect(args) -> httpx.Client:
    url = (args.url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    try:
        token = token_of(args)
    except TokenError as e:
        raise ClientError(exit_codes.USAGE, str(e)) from None
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"} if token else {},
                        timeout=httpx.Timeout(60, read=READ_TIMEOUT_S))


def _unreachable(client: httpx.Client, e: Exception) -> ClientError:
    return ClientError(exit_codes.SERVER_UNREACHABLE,
                       f"cannot reach the server at {client.base_url} ({e}). Fix: start `wan-s2v serve`, or give "
                       f"its address with --url / ${URL_ENV}")


def _raise_for(r: httpx.Response, refused_code: int = exit_codes.PREFLIGHT) -> None:
    """:class:`ClientError` with the server's one-line cause when ``r`` is an error (a 4xx exits
    ``refused_code``, a 5xx :data:`~exit_codes.SERVER_UNREACHABLE`); a streamed body is read first."""
    if r.status_code < 400:
        return
    r.read()
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text.strip()[:300]
    code = refused_code if r.status_code < 500 else exit_codes.SERVER_UNREACHABLE
    raise ClientError(code, f"the server answered {r.status_code}: {message}")


def _call(client: httpx.Client, method: str, path: str, **kw) -> Any:
    """One API call; its JSON body, or :class:`ClientError` with the server's one-line cause."""
    try:
        r = client.request(method, path, **kw)
    except httpx.HTTPError as e:
        raise _unreachable(client, e) from None
    _raise_for(r)
    return r.json()


def list_all(client: httpx.Client) -> list[dict]:
    """Every video, oldest first, page by page (``after`` the last one of the page before)."""
    videos: list[dict] = []
    params: dict[str, Any] = {"order": "asc", "limit": 100}
    while True:
        page = _call(client, "GET", "/v1/videos", params=params)
        videos += page["data"]
        if not page.get("has_more") or not page.get("last_id"):
            return videos
        params["after"] = page["last_id"]


# --------------------------------------------------------------------------- submit
def submission(args) -> tuple[dict[str, str], dict[str, Path]]:
    """The form fields (the job fields given as flags, as text) and the files to upload."""
    given = flag_values(args)
    for here in ("output", "preview"):  # where this client saves the video (so far): not the job's
        given.pop(here, None)
    files: dict[str, Path] = {}
    fields: dict[str, str] = {}
    for name, value in given.items():
        if name in INPUT_FIELDS and not args.server_paths:
            files[name] = Path(value).expanduser()
            continue
        value = getattr(value, "value", value)
        fields[name] = str(value).lower() if isinstance(value, bool) else str(value)
    for name, path in files.items():
        if not path.is_file():
            raise ClientError(exit_codes.USAGE, f"--{name} {path}: no such file. Fix: give the path of a file "
                                                "on this machine (or --server-paths for a path on the server)")
    return fields, files


class Follower:
    """Shows a job's video objects as they come: a live rich view on a terminal, plain lines
    otherwise (a stage change, and denoising progress at most every PROGRESS_EVERY_S)."""

    def __init__(self, rich: bool, out=sys.stdout):
        self.rich, self.out = rich, out
        self._live = None
        self._last_key: Optional[tuple] = None
        self._last_print = 0.0
        self._t0 = time.time()

    def __enter__(self) -> "Follower":
        if self.rich:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.out), refresh_per_second=4, transient=True)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()

    def show(self, v: dict[str, Any]) -> None:
        if self._live is not None:
            self._live.update(self._view(v))
            return
        key = (v["status"], v.get("stage"), position(v)[1])
        now = time.time()
        if key != self._last_key or (v.get("step") and now - self._last_print >= PROGRESS_EVERY_S):
            self._last_key, self._last_print = key, now
            print(f"[{fmt_seconds(now - self._t0)}] {v['id']}: {status_line(v)}", file=self.out, flush=True)

    def _view(self, v: dict[str, Any]):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        t = Table(title=f"wan-s2v job {v['id']}", title_justify="left", show_edge=False)
        unit, index, count = position(v)
        for col in ("status", "stage", unit.value, "step", "progress", "ETA", "elapsed"):
            t.add_column(col)
        t.add_row(v["status"], v.get("stage") or "-", f"{index or '-'}/{count or '-'}",
                  f"{v.get('step') or 0}/{v.get('steps') or '-'}", ProgressBar(total=100, completed=v["progress"],
                                                                              width=30),
                  fmt_seconds(v.get("eta_s")), fmt_seconds(time.time() - self._t0))
        return t


def status_line(v: dict[str, Any]) -> str:
    """One line of a video object: where it is."""
    if v["status"] == JobStatus.QUEUED:
        return f"queued (position {v.get('queue_position') or '?'})"
    if v["status"] == JobStatus.IN_PROGRESS:
        unit, index, count = position(v)
        if unit is ProgressUnit.BLOCK:  # a live job: its blocks, no steps
            where = f", block {index}/{count or '?'}" if index is not None else ""
            made, total = v.get("blocks_done"), v.get("blocks_total")
        else:
            where = (f", clip {index}/{count or '?'}, step {v.get('step')}/{v.get('steps') or '?'}"
                     if v.get("step") is not None else "")
            made, total = v.get("clips_done"), v.get("clips_total")
        done = f", {unit.plural} {made}/{total} done" if total is not None and made is not None else ""
        eta = f", ETA {fmt_seconds(v['eta_s'])}" if v.get("eta_s") is not None else ""
        return f"{v.get('stage') or 'starting'}{where} ({v['progress']}%){done}{eta}"
    if v["status"] == JobStatus.COMPLETED:
        return f"completed in {fmt_seconds(v.get('wall_s'))}"
    return f"{v['status']}: {(v.get('error') or {}).get('message', '')}"


def follow(client: httpx.Client, video_id: str, follower: Follower,
           on_video: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """The job's video objects from its event stream until it ends (each also to ``on_video``);
    the last one. A dropped stream or an absent server (it may be restarting: the job resumes
    there) is retried for up to :data:`RECONNECT_S`."""
    gone_since: Optional[float] = None
    while True:
        try:
            with client.stream("GET", f"/v1/videos/{video_id}/events") as stream:
                _raise_for(stream)
                gone_since = None
                for line in stream.iter_lines():
                    if line.startswith("data:"):
                        last = json.loads(line[5:])
                        follower.show(last)
                        if on_video is not None:
                            on_video(last)
                        if JobStatus(last["status"]).terminal:
                            return last
        except httpx.HTTPError as e:
            gone_since = gone_since or time.time()
            if time.time() - gone_since > RECONNECT_S:
                raise _unreachable(client, e) from None
        time.sleep(2.0)


class PartialSaver:
    """``submit --preview``: the job's video so far in ``dest``, extended each time it grows
    (``preview_clips`` in the video object) by what is new only (a Range request: the file only
    ever grows at its end), so a long job's video so far costs O(1) a clip to follow."""

    def __init__(self, client: httpx.Client, dest: Path):
        self.client, self.dest, self.clips = client, dest, 0

    def __call__(self, video: dict[str, Any]) -> None:
        clips = video.get("preview_clips") or 0
        if clips > self.clips:
            try:
                extend(self.client, video["id"], self.dest)
            except ClientError:  # gone already (the job ended meanwhile): the final video follows
                return
            self.clips = clips
            print(f"video so far: {self.dest} ({clips} clip{'s' if clips > 1 else ''})", file=sys.stderr, flush=True)


def extend(client: httpx.Client, video_id: str, dest: Path) -> Path:
    """``dest`` (the video so far, as fetched before) extended by what the server's has beyond it;
    the whole of it (:func:`download`) when there is nothing yet or the server sends it all."""
    have = dest.stat().st_size if dest.is_file() else 0
    if have == 0:
        return download(client, video_id, dest, variant="partial")
    try:
        with client.stream("GET", f"/v1/videos/{video_id}/content", params={"variant": "partial"},
                           headers={"Range": f"bytes={have}-"}) as r:
            if r.status_code == 416:  # nothing new yet
                return dest
            _raise_for(r, refused_code=exit_codes.SERVER_UNREACHABLE)
            if r.status_code != 206:  # the whole file: written anew
                r.close()
                return download(client, video_id, dest, variant="partial")
            with open(dest, "ab") as f:
                for chunk in r.iter_bytes():
                    f.write(chunk)
    except httpx.HTTPError as e:
        raise _unreachable(client, e) from None
    return dest


def download(client: httpx.Client, video_id: str, dest: Path, variant: str = "video") -> Path:
    """The job's mp4 (``variant``: or its video so far) to ``dest`` (a temporary name, renamed when complete)."""
    def write(tmp: Path) -> None:
        try:
            with client.stream("GET", f"/v1/videos/{video_id}/content", params={"variant": variant}) as r:
                _raise_for(r, refused_code=exit_codes.SERVER_UNREACHABLE)
                with open(tmp, "wb") as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
        except httpx.HTTPError as e:
            raise _unreachable(client, e) from None

    return atomic.atomic_write(dest, write)


def destination(output: Optional[Path], video_id: str) -> Path:
    """Where ``submit`` writes the mp4: ``--output``, ``ID.mp4`` in it when it is a directory,
    else ``ID.mp4`` here."""
    if output is None:
        return Path(f"{video_id}.mp4").absolute()
    output = output.expanduser().absolute()
    return output / f"{video_id}.mp4" if output.is_dir() else output


def submit_job(client: httpx.Client, fields: dict[str, str], files: dict[str, Path],
               patience_s: float = RECONNECT_S) -> dict[str, Any]:
    """POST the job, with an ``Idempotency-Key``; again while the server cannot take it (no
    answer, or 503), for up to ``patience_s``: the same key, so the server makes it once. Its
    video object, or :class:`ClientError`."""
    key = f"wan-s2v-submit-{uuid.uuid4().hex}"
    deadline = time.time() + patience_s
    while True:
        with ExitStack() as opened:
            uploads = {name: (path.name, opened.enter_context(open(path, "rb"))) for name, path in files.items()}
            try:
                r = client.post("/v1/videos", data=fields, files=uploads or None, headers={"Idempotency-Key": key})
            except httpx.HTTPError as e:
                if time.time() >= deadline:
                    raise _unreachable(client, e) from None
                why, wait = f"no answer ({type(e).__name__})", 2.0
            else:
                if r.status_code != 503 or time.time() >= deadline:
                    _raise_for(r)
                    return r.json()
                try:
                    why = r.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    why = r.text.strip()[:200]
                wait = float(r.headers.get("Retry-After") or 5)
        wait = max(0.5, min(wait, 30.0, deadline - time.time()))
        print(f"the server cannot take the job now ({why}); sending it again in {wait:.0f} s (the same request: "
              "it is made once)", file=sys.stderr, flush=True)
        time.sleep(wait)


def cmd_submit(args) -> int:
    try:
        fields, files = submission(args)
        with connect(args) as client:
            video = submit_job(client, fields, files)
            print(f"submitted {video['id']} to {client.base_url}", file=sys.stderr, flush=True)
            if args.no_wait:
                print(json.dumps(video, indent=2) if args.json else video["id"])
                return exit_codes.OK
            from wan_s2v_runner.shared.media import partial_path

            dest = destination(args.output, video["id"])
            saver = PartialSaver(client, partial_path(dest)) if args.preview else None
            with Follower(rich=sys.stdout.isatty() and not args.json, out=sys.stderr if args.json else sys.stdout) as f:
                video = follow(client, video["id"], f, on_video=saver)
            if video["status"] == JobStatus.COMPLETED:
                dest = download(client, video["id"], dest)
                video = {**video, "downloaded_to": str(dest)}
                if saver is not None:  # the whole video is here: the part goes
                    saver.dest.unlink(missing_ok=True)
            elif saver is not None and saver.clips:  # a cancelled or failed job: what it made stays
                video = {**video, "partial_saved_to": str(saver.dest)}
            if args.json:
                print(json.dumps(video, indent=2))
            else:
                saved = video.get("downloaded_to") or video.get("partial_saved_to")
                print(f"{video['id']}: {status_line(video)}" + (f" -> {saved}" if saved else ""))
            return exit_codes.OK if video["status"] == JobStatus.COMPLETED else exit_codes.JOB_FAILED
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except OSError as e:  # the mp4 could not be written here
        print(f"error: {e}. Fix: give --output a writable path (the video stays on the server: wan-s2v jobs)",
              file=sys.stderr)
        return exit_codes.SERVER_UNREACHABLE
    except KeyboardInterrupt:
        print("interrupted: the job goes on on the server (wan-s2v jobs lists it)", file=sys.stderr)
        return exit_codes.INTERRUPTED


# --------------------------------------------------------------------------- jobs
def jobs_table(videos: list[dict[str, Any]], rich: bool) -> None:
    cols = ("id", "status", "where", "prompt", "seed", "created")
    rows = [
        (
            v["id"],
            v["status"],
            status_line(v) if v["status"] != JobStatus.COMPLETED else fmt_seconds(v.get("wall_s")),
            (v.get("prompt") or "")[:40],
            str(v.get("seed")),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"])),
        )
        for v in videos
    ]
    if rich:
        from rich.console import Console
        from rich.table import Table

        t = Table(show_edge=False)
        for c in cols:
            t.add_column(c)
        for row in rows:
            t.add_row(*row)
        Console().print(t)
    else:
        for row in rows:
            print("\t".join(row))


def cmd_jobs(args) -> int:
    try:
        with connect(args) as client:
            if args.cancel:
                if not args.ids:
                    raise ClientError(exit_codes.USAGE, "--cancel needs the ids of the jobs to cancel. Fix: "
                                                        "wan-s2v jobs --cancel ID [ID ...]")
                videos = [_call(client, "POST", f"/v1/videos/{i}/cancel") for i in args.ids]
            elif args.ids:
                videos = [_call(client, "GET", f"/v1/videos/{i}") for i in args.ids]
            else:
                videos = list_all(client)
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    if args.json:
        print(json.dumps(videos, indent=2))
    else:
        jobs_table(videos, rich=sys.stdout.isatty())
    return exit_codes.OK
