"""A job submitted to the server, checked before it is queued.

The fields a client may set are a job's (:class:`~wan_s2v_runner.shared.spec.JobSpec`, as a
batch line sets them) but its outputs (:data:`SUBMIT_FIELDS`), typed and constrained as the job
spec types them: the request model :data:`VideoJobFields` is those fields of ``JobSpec``, each
optional (the server's flags give the defaults), not written again), any spelling the flags
accept (``size``, ``sample_steps``, ...), plus the input files: ``image`` (also
``input_reference``, OpenAI's name) and ``audio``, each an upload or a path on the server. The
checks, in order, each refusal one line with its cause and fix:

1. the fields validate (422); unknown fields are refused (``model`` is accepted and ignored:
   OpenAI clients send it, the server runs one model);
2. a path is absolute, has no ``..``, and lies (after resolving symlinks) under an
   ``--allow-dir`` root (403); an upload is at most ``--max-upload-mb`` (413);
3. the job validates as a ``JobSpec`` over the server's defaults, on the server's rank group
   (:func:`~wan_s2v_runner.launcher.job_book.job_spec`) (422);
4. preflight, as ``run`` does it, for this job (inputs read and decoded as the engine will,
   sizes, the memory plan for its size) (422).

Only then is the job queued (429 when ``--max-queue`` jobs wait already). Job ids are random,
made before anything is stored; a request with an ``Idempotency-Key`` header (as OpenAI's API
takes it) sent again gives the job the first one made (:func:`request_hash` tells a retry from
another request under the same key: 409). A string no store can hold (a NUL character) is
refused (422) on every store. Error bodies name files by the client's field names, never by the
server's paths (:func:`scrub`).
"""
from __future__ import annotations

import errno
import hashlib
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Optional, Union

from pydantic import ConfigDict, ValidationError, create_model
from pydantic.fields import FieldInfo

from wan_s2v_runner.launcher.job_book import job_spec, normalized, refusal
from wan_s2v_runner.shared import media
from wan_s2v_runner.shared.jobs import INPUT_FIELDS, SUBMIT_FIELDS
from wan_s2v_runner.shared.spec import GroupSpec, JobSpec, RunSpec

#: the most pixels a reference image may have (by its header; a 4K image has 8.3 MP)
MAX_IMAGE_PIXELS = 40_000_000
#: the inputs: field name -> the names a client may send it under
INPUT_NAMES = {name: (name,) for name in INPUT_FIELDS} | {"image": ("image", "input_reference")}
#: input files a job may go without (the audio too when it sends tts_text)
OPTIONAL_INPUTS = ("pose_video", "tts_prompt_audio")
#: accepted and ignored (OpenAI clients send the model's name)
IGNORED = ("model",)
ID_PATTERN = re.compile(r"^video_[0-9a-f]{24}$")


def _optional(name: str) -> tuple[Any, FieldInfo]:
    info = JobSpec.model_fields[name]
    return Optional[info.annotation], FieldInfo.merge_field_infos(info, default=None)


#: a submission's own fields, typed, constrained and described as the run spec's (all optional:
#: the server's flags give the defaults)
VideoJobFields = create_model("VideoJobFields", __config__=ConfigDict(extra="forbid", allow_inf_nan=False),
                              **{name: _optional(name) for name in SUBMIT_FIELDS})


class Refused(Exception):
    """A request the server does not do: an HTTP status and one line (cause and fix); ``code``:
    the error's code (OpenAI's ``error.code``); ``retry_after``: seconds a client should wait."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after


#: the longest Idempotency-Key taken (OpenAI's: 255 characters)
MAX_KEY = 255


def idempotency_key(value: Optional[str]) -> Optional[str]:
    """An ``Idempotency-Key`` header's value, checked: 1 to 255 printable ASCII characters."""
    if value is None:
        return None
    if not (0 < len(value) <= MAX_KEY and all(" " < c <= "~" for c in value)):
        raise Refused(400, f"Idempotency-Key: 1 to {MAX_KEY} printable characters without spaces. Fix: send e.g. a "
                           "UUID", "Idempotency-Key")
    return value


def request_hash(fields: dict[str, Any]) -> str:
    """A submission's digest (its text fields and its files' bytes): a request sent again under
    the same ``Idempotency-Key`` has the same one. The files are read from their start and left
    there."""
    h = hashlib.sha256()
    for name in sorted(fields):
        value = fields[name]
        h.update(name.encode() + b"=")
        if isinstance(value, Upload):
            value.file.seek(0)
            for chunk in iter(lambda f=value.file: f.read(1 << 20), b""):
                h.update(chunk)
            value.file.seek(0)
        else:
            h.update(repr(value).encode())
        h.update(b";")
    return h.hexdigest()


def scrub(text: Optional[str], roots: Iterable[Path], names: Optional[dict[str, str]] = None) -> Optional[str]:
    """``text`` without the server's paths: a path ``names`` knows (a job's input file) becomes
    the client's field name for it (``<image>``), any other path under one of ``roots`` (the server's and the
    shared directory, the allowed directories, the checkpoint) becomes ``<server path>``."""
    if not text:
        return text
    for path, field in sorted((names or {}).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, f"<{field}>")
    prefixes = sorted({str(r).rstrip("/") for r in roots if r and str(r) not in ("", "/")}, key=len, reverse=True)
    if prefixes:
        pattern = "(" + "|".join(re.escape(p) for p in prefixes) + r")(/[^\s'\"(),;]*)?"
        text = re.sub(pattern, "<server path>", text)
    return text


def input_names(spec: dict[str, Any]) -> dict[str, str]:
    """A job's input files (as its spec names them) -> the field each came in."""
    return {str(spec[k]): k for k in INPUT_FIELDS if spec.get(k)}


def storable(fields: dict[str, Any]) -> None:
    """A field no store can hold (a NUL character, which PostgreSQL refuses; a lone surrogate, not
    UTF-8): refused (422) whatever the store."""
    from wan_s2v_runner.serve.store.rules import unstorable

    for name, value in fields.items():
        why = unstorable(str(name)) or (unstorable(value) if isinstance(value, str) else None)
        if why:
            param = name if unstorable(str(name)) is None else None
            raise Refused(422, f"{param or 'a field name'}: {why}. Fix: send plain text (no \\u0000, no lone "
                               "surrogate)", param)


def storage_refusal(e: OSError, what: str) -> Refused:
    """An upload the shared directory could not take: 507 when it is full, else 503, with the
    cause (never 500)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return Refused(507, f"{what}: the server's disk is full. Fix: retry later, or ask the operator to free space")
    return Refused(503, f"{what}: the server cannot store it now ({e.strerror or type(e).__name__}). Fix: retry "
                        "later; /health says what the server's shared directory is doing",
                   code="shared_dir_unavailable", retry_after=10)


@dataclass(frozen=True)
class Upload:
    """An uploaded file: its name as the client gave it, and its bytes (a file object)."""

    filename: str
    file: BinaryIO


@dataclass(frozen=True)
class Policy:
    """What the server accepts: path roots, upload size, and the media limits read from headers
    before anything is decoded (a compressed file of a few hundred KB can decode to gigabytes)."""

    allow_dirs: tuple[Path, ...]
    max_upload_bytes: int
    max_audio_s: float = 600.0  # speech, voice prompt and pose video, by their headers
    max_image_pixels: int = MAX_IMAGE_PIXELS


def media_refusal(field: str, path: Path, policy: Policy) -> Optional[Refused]:
    """An input over the server's media limits, by its header alone (None: within them, or not
    readable here: preflight reads it next and says why)."""
    if field == "image":
        from PIL import Image

        try:
            with Image.open(path) as im:
                width, height = im.size
        except Image.DecompressionBombError:
            width, height = policy.max_image_pixels + 1, 1
        except Exception:
            return None
        if width * height > policy.max_image_pixels:
            return Refused(413, f"image: {width}x{height} is {width * height / 1e6:.0f} MP; this server takes at most "
                                f"{policy.max_image_pixels / 1e6:.0f} MP. Fix: send a smaller image (the video is "
                                "made at the size asked, whatever the image's)", field)
        return None
    seconds = media.header_seconds(path)
    if seconds is not None and seconds > policy.max_audio_s:
        return Refused(413, f"{field}: {seconds:.0f} s long; this server takes at most {policy.max_audio_s:.0f} s "
                            "(--max-audio-s). Fix: send a shorter file", field)
    return None


def new_id() -> str:
    return f"video_{secrets.token_hex(12)}"


def allowed_path(value: str, param: str, policy: Policy) -> Path:
    """A path input, accepted only under an ``--allow-dir`` root (symlinks resolved first)."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise Refused(400, f"{param}: {value!r} is not an absolute path. Fix: give the full path on the "
                           "server, or upload the file", param)
    if ".." in path.parts:
        raise Refused(403, f"{param}: {value!r} contains '..'. Fix: give the path without '..'", param)
    if not policy.allow_dirs:
        raise Refused(403, f"{param}: this server takes no paths. Fix: upload the file, or start the server "
                           "with --allow-dir DIR", param)
    real = path.resolve()
    for root in policy.allow_dirs:
        if real.is_relative_to(root.resolve()):
            return real
    raise Refused(403, f"{param}: the path is outside the directories this server reads. Fix: put the file in one "
                       "of them (the operator knows which), or upload it", param)


def save_upload(upload: Upload, dest_dir: Path, name: str, policy: Policy) -> Path:
    """Copy an upload to ``dest_dir/NAME.SUFFIX`` (its suffix kept if plain), at most
    ``policy.max_upload_bytes``."""
    suffix = Path(upload.filename or "").suffix.lower()
    if not re.fullmatch(r"\.[a-z0-9]{1,8}", suffix):
        suffix = ""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / f"{name}{suffix}"
    size = 0
    with open(dest, "wb") as out:
        while True:
            chunk = upload.file.read(1 << 20)
            if not chunk:
                break
            size += len(chunk)
            if size > policy.max_upload_bytes:
                raise Refused(413, f"{name}: the upload is over {policy.max_upload_bytes // 2**20} MB. Fix: send a "
                                   "smaller file (or start the server with a larger --max-upload-mb)", name)
            out.write(chunk)
    if size == 0:
        raise Refused(422, f"{name}: the upload is empty. Fix: send the file's contents", name)
    return dest


def _field_error(e: ValidationError) -> Refused:
    err = e.errors()[0]
    param = ".".join(str(x) for x in err.get("loc", ())) or None
    if err.get("type") == "extra_forbidden":
        known = ", ".join((*INPUT_FIELDS, *SUBMIT_FIELDS))
        return Refused(422, f"{param}: not a job field. Fix: use one of {known}", param)
    return Refused(422, f"{param}: {err.get('msg')} (got {err.get('input')!r})", param)


#: preflight checks named other than the field they are about
CHECK_FIELDS = {"tts": "tts_text"}


def _param_of(cause: str) -> Optional[str]:
    """The field a preflight refusal is about, when it says (``preflight inputs.audio: ...``)."""
    m = re.match(r"preflight (\w+)\.(\w+)", cause)
    field = CHECK_FIELDS.get(m.group(2), m.group(2)) if m else None
    if field in (*INPUT_FIELDS, *SUBMIT_FIELDS):
        return field
    m = re.match(r"(\w+)[:,]", cause)
    return m.group(1) if m and m.group(1) in (*INPUT_FIELDS, *SUBMIT_FIELDS) else None


#: the longest video ``seconds`` may ask for (a longer one: ``num_clips``, knowingly)
MAX_SECONDS = 600


def _clips_for(seconds: Any, own: dict[str, Any], base: dict[str, Any]) -> int:
    if "num_clips" in own:
        raise Refused(422, "seconds: sent with num_clips. Fix: send one of them", "seconds")
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if not (0 < value <= MAX_SECONDS):  # NaN too
        raise Refused(422, f"seconds: {seconds!r} is not a length from 0 to {MAX_SECONDS} s. Fix: send e.g. "
                           "seconds=4", "seconds")
    per_clip = int(own.get("infer_frames") or base.get("infer_frames") or JobSpec.model_fields["infer_frames"].default)
    return media.clips_for_seconds(value, per_clip)


def build_job(fields: dict[str, Union[str, Upload]], *, job_id: str, base: dict[str, Any], group: GroupSpec,
              videos: Path, uploads: Path, policy: Policy, facts=None, session=None) -> RunSpec:
    """A submission's fields -> the job's spec on ``group`` (``base``: the server's job defaults),
    checked (see the module's docstring); raises :class:`Refused`. Uploads go to ``uploads/ID/``
    (removed again when the job is refused). ``session``: a live session's pace (its speech comes
    later, through the session: no audio is asked for)."""
    try:
        return _build_job(fields, job_id=job_id, base=base, group=group, videos=videos, uploads=uploads,
                          policy=policy, facts=facts, session=session)
    except OSError as e:  # the uploads could not be written
        shutil.rmtree(uploads / job_id, ignore_errors=True)
        raise storage_refusal(e, "the upload") from None
    except Refused:
        shutil.rmtree(uploads / job_id, ignore_errors=True)
        raise


def _build_job(fields, *, job_id, base, group, videos, uploads, policy, facts, session=None) -> RunSpec:
    storable(fields)
    given = {k: v for k, v in fields.items() if k not in IGNORED}
    inputs: dict[str, Path] = {}
    for field, names in INPUT_NAMES.items():
        sent = [given.pop(n) for n in names if n in given]
        if len(sent) > 1:
            raise Refused(422, f"{field}: sent twice (as {' and '.join(names)}). Fix: send it once", field)
        if session is not None and field in ("audio", "tts_prompt_audio"):
            if sent:
                raise Refused(422, f"{field}: a live session's speech is appended to it, not sent with it. Fix: "
                                   "POST it to /v1/videos/sessions/ID/speech", field)
            continue
        if not sent and base.get(field):  # the server's own default (--image/--audio)
            inputs[field] = Path(base[field])
            continue
        if not sent and (field in OPTIONAL_INPUTS or (field == "audio" and given.get("tts_text"))):
            continue
        if not sent:
            raise Refused(422, f"{field}: required. Fix: upload it (multipart field {names[-1]!r}) or give its "
                               "path on the server", field)
        value = sent[0]
        if isinstance(value, Upload):
            inputs[field] = save_upload(value, uploads / job_id, field, policy)
        else:
            inputs[field] = allowed_path(str(value), field, policy)
        too_big = media_refusal(field, inputs[field], policy)
        if too_big is not None:
            raise too_big
    uploads_given = [k for k, v in given.items() if isinstance(v, Upload)]
    if uploads_given:
        raise Refused(422, f"{uploads_given[0]}: a file was sent for a field that is not a file. Fix: send "
                           "it as a plain value", uploads_given[0])
    values = normalized(given)
    seconds = values.pop("seconds", None)
    try:
        own = VideoJobFields(**values).model_dump(exclude_none=True)
    except ValidationError as e:
        raise _field_error(e) from None
    if seconds is not None:  # OpenAI's length: as many clips as it takes
        own["num_clips"] = _clips_for(seconds, own, base)
    # a served job always keeps its video so far (videos/ID.partial.mp4, ID.thumbnail.jpg)
    if session is not None:
        own["session"] = session
        base = {k: v for k, v in base.items() if k not in ("audio", "tts_text")}  # the server's default speech
    spec, cause = job_spec({**own, **inputs, "preview": True}, base, group, videos, job_id)
    if spec is None:
        raise Refused(422, cause, _param_of(cause))
    from wan_s2v_runner.preflight import check_run

    report = check_run(spec, facts, group_running=True)
    if report.refused:
        cause = refusal(report)
        raise Refused(422, cause, _param_of(cause))
    return spec
