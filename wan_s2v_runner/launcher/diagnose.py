"""Reading a failed or stuck run: exit statuses, torch elastic error files, stack dumps, hints,
and which rank failed first.

Functions over the run directory and the ranks' states, used by the launcher's failure and hang
reports (and directly by tests). :func:`attribute_failures` is the failure verdict: from what
the launcher gathered (the ranks' events, error files, exit times and exit codes) it returns one
:class:`RankFailure` per failed rank, the cause first; it touches no process and no file.
"""
from __future__ import annotations

import logging
import re
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, Union

from wan_s2v_runner.shared.events import EventReader, RankState, denoise_position, is_secondary, position
from wan_s2v_runner.shared.layout import MODES, ModeTraits
from wan_s2v_runner.shared.node_agent import AGENT_MODULE, DEFAULT_WORKER
from wan_s2v_runner.shared.spec import RunSpec
from wan_s2v_runner.shared.stages import Stage

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

#: how a rank's main thread shows in a stack dump: the worker's frames, or the agent's it was forked from
MAIN_THREAD_FILES = tuple(m.replace(".", "/") + ".py" for m in (DEFAULT_WORKER, AGENT_MODULE))


def has_frame(path: Path) -> bool:
    try:
        return 'File "' in path.read_text(errors="replace")
    except OSError:
        return False


def progress_suffix(st: RankState) -> str:
    p = st.progress
    if st.stage == Stage.DENOISE and position(p)[1]:
        return f" ({denoise_position(p)})"
    return ""


def where_ranks_were(reader: EventReader, expected: list[int]) -> str:
    st = reader.ranks.get(min(expected)) if expected else None
    return f"rank {st.rank} was in {st.stage}{progress_suffix(st)}" if st else ""


def first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def parse_torchrun_exits(log_path: Path) -> dict[int, int]:
    """global rank -> exit code, from torchrun's failure summary (negative: killed by signal)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    return {int(m.group(1)): int(m.group(3)) for m in _EXIT_RE.finditer(text)}


#: torch elastic's logger that :class:`ProcessFailure` reports an unreadable error file on
_TORCH_ERRORS_LOGGER = "torch.distributed.elastic.multiprocessing.errors"


@dataclass(frozen=True)
class ErrorFile:
    """One rank's torch elastic error file (``@record`` on ``worker.main`` writes it when the
    rank raises): ``logs/<id>/attempt_<n>/<local_rank>/error.json``. Read by torch's own
    :class:`~torch.distributed.elastic.multiprocessing.errors.ProcessFailure` (``failure``);
    this adds only where the file is and the local rank its directory names."""

    path: Path
    local_rank: int  # from the directory name (torchrun's log dir layout)
    failure: "ProcessFailure"  # torch's reading (its pid -1 and exitcode 1 stand in: not known here)

    @property
    def _structured(self) -> Optional[dict]:
        """The error handler's structured message (``message``, ``extraInfo``: ``py_callstack``,
        ``timestamp``), or None when the file holds a plain string message."""
        msg = self.failure.message
        return msg if isinstance(msg, dict) else None

    @property
    def traceback(self) -> str:
        """The Python traceback (or the bare message when there is none)."""
        d = self._structured
        if d is None:  # the file's own string (torch makes one up when it is empty)
            return str(self.failure.error_file_data.get("message") or "").strip()
        return str(d.get("extraInfo", {}).get("py_callstack") or d.get("message") or "").strip()

    @property
    def message(self) -> str:
        """The exception line, ``Type: message``: the error handler's own line, else the
        traceback's last line."""
        d = self._structured
        text = str(d.get("message") or "").strip() if d is not None else ""
        if not text:
            lines = self.traceback.splitlines()
            text = lines[-1].strip() if lines else ""
        return text or "(no message)"

    @property
    def error_type(self) -> str:
        """The exception's type name: ``message`` up to its first colon (the error handler writes
        ``f"{type(e).__name__}: {e}"``)."""
        return self.message.partition(":")[0].strip()

    @property
    def timestamp(self) -> int:
        """When it was written, whole unix seconds."""
        return self.failure.timestamp


@contextmanager
def _quiet_torch_errors() -> Iterator[None]:
    """Keep torch's ``Failed to parse reply file`` log (with its traceback) off the launcher's
    output: an unreadable error file is left out silently."""
    log = logging.getLogger(_TORCH_ERRORS_LOGGER)
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


def read_error_files(run_dir: Path, rank_offset: int = 0) -> dict[int, ErrorFile]:
    """global rank (= offset + local rank) -> its torch elastic error file, each read by torch's
    ``ProcessFailure``; files that are unreadable, gone, or not in the error handler's format are
    left out. Torch is imported only when there is a file to read (the launcher starts without it)."""
    paths = sorted((run_dir / "logs").glob("*/attempt_*/*/error.json"))
    if not paths:
        return {}
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    out: dict[int, ErrorFile] = {}
    for ef in paths:
        try:
            local = int(ef.parent.name)
            with _quiet_torch_errors():
                failure = ProcessFailure(local_rank=local, pid=-1, exitcode=1, error_file=str(ef))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if failure.error_file != str(ef):  # gone before torch read it ("<N/A>")
            continue
        out[rank_offset + local] = ErrorFile(ef, local, failure)
    return out


_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME_RE = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)


#: our functions that block on point-to-point transfers (``vae_split.await_peers``)
PEER_WAITS = ("await_peers",)


def analyse_stacks(run_dir: Path, ranks: list[int], remote: Optional[str] = None) -> list[str]:
    """One line per rank: where its main thread is (top frame), and whether it waits in a
    torch.distributed collective (or a point-to-point wait). Ranks *not* waiting while others
    wait are the suspects. ``remote``: the other nodes (:func:`other_nodes_text`), named when
    every rank here waits, so the one holding them up is elsewhere."""
    lines, in_coll, outside = [], [], []
    for r in ranks:
        try:
            text = (run_dir / "stacks" / f"rank{r}.txt").read_text(errors="replace")
        except OSError:
            continue
        blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text) if _FRAME_RE.search(b)]
        main = next((b for b in blocks if any(f in b for f in MAIN_THREAD_FILES) or "in <module>" in b), None)
        if main is None:
            continue
        frames = _FRAME_RE.findall(main)
        top = frames[0]
        coll = next((fn for path, _, fn in frames if path.endswith("distributed_c10d.py") or fn in PEER_WAITS), None)
        at = f"{Path(top[0]).name}:{top[1]} in {top[2]}"
        if coll:
            in_coll.append(r)
            lines.append(f"rank {r}: waiting in collective {coll} (top frame {at})")
        else:
            outside.append(r)
            lines.append(f"rank {r}: not in a collective, at {at}")
    if in_coll and outside:
        lines.append(f"-> rank(s) {','.join(map(str, outside))} did not reach the collective the others "
                     "wait in: look there first")
    elif in_coll and remote:
        lines.append(f"-> every rank of this node waits for its peers, so what holds them up is on {remote}: "
                     "that node stopped, froze, or lost its network. Read its launcher output and run directory")
    elif remote and lines:  # NCCL returns from a collective at once and blocks later, elsewhere
        lines.append(f"-> with several nodes, the rank holding these up may be on {remote}: check that node too")
    return lines


def tail_lines(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _describe(traits: ModeTraits) -> str:
    """'Ulysses + FSDP DiT + T5 on CPU': what a mode does, from its traits."""
    parts = [name for name, on in (("Ulysses", traits.sequence_parallel), ("FSDP DiT", traits.dit_fsdp),
                                   ("FSDP T5", traits.t5_fsdp), ("T5 on CPU", traits.t5_cpu)) if on]
    return " + ".join(parts) or "no sharding"


def _modes_that(want, spec: Optional[RunSpec], why=_describe) -> list[str]:
    """'--mode X (why)' for every mode but the run's own whose traits satisfy ``want``;
    ``why(traits)`` says what it does (default: :func:`_describe`). Never the live mode: another
    recipe, not a layout of the same job."""
    current = spec.mode if spec else None
    return [f"--mode {m.value} ({why(t)})" for m, t in MODES.items()
            if m != current and not t.step_pipeline and want(t)]


#: stages that load or place weights: an OOM there is about where the weights live
_WEIGHT_STAGES = frozenset({Stage.ENGINE_IMPORT, Stage.LOAD, Stage.FINGERPRINT, Stage.SHARD})
#: stages that run the VAE (every rank decodes the whole clip)
_VAE_STAGES = frozenset({Stage.REF_ENCODE, Stage.POSE_ENCODE, Stage.DECODE, Stage.MOTION_ENCODE})


def _oom_hint(stage: Union[Stage, str], spec: Optional[RunSpec]) -> str:
    """What to change after a GPU OOM in ``stage``, decided from the run's layout (what is
    sharded, split or on the CPU), so a new mode needs no edit here."""
    mode = spec.mode.value if spec else "?"
    lay = spec.layout if spec else None
    if stage in _WEIGHT_STAGES:
        if lay is not None and not lay.dit_fsdp:
            fix = " or ".join(_modes_that(lambda t: t.dit_fsdp, spec)) or "more ranks"
        elif lay is not None and not lay.t5_cpu:
            fix = " or ".join(_modes_that(lambda t: t.dit_fsdp and t.t5_cpu, spec) + ["more ranks"])
        else:
            fix = "more ranks"
        return f"GPU out of memory while loading weights ({mode}): try {fix}."
    if stage == Stage.TEXT_ENCODE:
        cpu_t5 = _modes_that(lambda t: t.t5_cpu, spec) if lay is None or not lay.t5_cpu else []
        if cpu_t5:
            return (f"GPU out of memory in the text encoder ({mode}): {' or '.join(cpu_t5)} "
                    "keeps T5 on the CPU.")
        return f"GPU out of memory in the text encoder ({mode}): more ranks or a smaller --size."
    if stage in _VAE_STAGES:
        return ("GPU out of memory in the VAE (every rank decodes the whole clip): a smaller --size "
                "or fewer --infer-frames; --offload-model frees the DiT's memory first.")
    if stage == Stage.DENOISE:
        splits_both = lay is not None and lay.use_sp and lay.dit_fsdp
        both = [] if splits_both else _modes_that(lambda t: t.sequence_parallel and t.dit_fsdp, spec)
        more = f"{' or '.join(both)} with more ranks splits" if both else "more ranks split"
        return (f"GPU out of memory while denoising ({mode}): {more} both weights and activations; "
                "a smaller --size or fewer --infer-frames shrinks activations.")
    leanest = _modes_that(lambda t: t.dit_fsdp and t.t5_cpu, spec)
    fix = ", ".join(leanest + ["more ranks"])
    return f"GPU out of memory in {stage} ({mode}): try {fix}, or a smaller --size."


HINTS = [
    ("out of memory", None),  # stage/mode aware, see _oom_hint
    ("timed out", "A collective timed out: one rank is far behind or dead. Look for an earlier "
                  "failure on another rank (or node); raise --pg-timeout for slow storage."),
    ("watchdog caught collective", "NCCL's watchdog fired: a rank stopped joining collectives. Look "
                                   "for an earlier failure on another rank (or node)."),
    ("no such file", "A file is missing: run `wan-s2v doctor` with the same flags to check the "
                     "checkpoint and inputs."),
    ("filenotfound", "A file is missing: run `wan-s2v doctor` with the same flags to check the "
                     "checkpoint and inputs."),
    ("undefined symbol", "flash-attn was built for another torch: rebuild it, or use --attention sdpa."),
    ("weightmismatch", "Give every node identical checkpoint files (compare their sha256)."),
    ("does not open as audio", "The mp4 could not get its audio: check the audio file decodes "
                               "(`wan-s2v doctor --audio ...`)."),
    ("no space left", "The disk is full: free space, then `wan-s2v resume RUN_DIR` (every finished clip "
                      "is kept in OUTPUT.partial.mp4)."),
]


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 6, 7] -> '0-3, 6-7'; [1] -> '1'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ", ".join(out)


def other_nodes_text(spec: RunSpec) -> str:
    """'node 1 of 2 (global rank 1)', 'one of nodes 0, 1, 3 of 4 (global ranks 0-3, 6-7)'."""
    others = spec.other_nodes
    ranks = [r for n in others for r in spec.node_ranks(n)]
    which = f"node {others[0]}" if len(others) == 1 else f"one of nodes {', '.join(map(str, others))}"
    return f"{which} of {spec.nnodes} (global rank{'s' if len(ranks) > 1 else ''} {_spans(ranks)})"


_PEER_ADDR_RE = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")


def peer_lost_hint(text: str, spec: Optional[RunSpec] = None) -> str:
    """A rank lost its connection to a peer: with several nodes and no local cause, name them."""
    if spec is None or spec.nnodes == 1:
        return ("This rank lost its connection to a peer: the peer failed or was killed first (read "
                "the other ranks' errors above).")
    m = _PEER_ADDR_RE.search(text)
    addr = f", peer address {m.group(1)}" if m else ""
    return (f"This rank lost its connection to a peer on another node: {other_nodes_text(spec)} went away "
            f"first{addr} (a rank there failed, the node was stopped, or it went down or off the "
            "network). Read that node's launcher output and its run directory.")


def hint_for(text: str, stage: Union[Stage, str, None] = None,
             spec: Optional[RunSpec] = None) -> Optional[str]:
    """A hint for an error message raised in ``stage`` (None when no known cause matches)."""
    low = text.lower()
    if is_secondary(text):
        return peer_lost_hint(text, spec)
    for key, hint in HINTS:
        if key in low:
            return hint if hint is not None else _oom_hint(stage if stage is not None else "?", spec)
    return None


def death_hint(exitcode: Optional[int], crash_stack: Optional[Path], spec: Optional[RunSpec] = None) -> str:
    """A hint for a rank that ended without a Python exception."""
    if exitcode == -signal.SIGKILL:
        shards = spec is None or spec.layout.dit_fsdp or spec.layout.t5_fsdp
        unsharded = _modes_that(lambda t: not (t.dit_fsdp or t.t5_fsdp), spec,
                                lambda t: "no CPU-side FSDP copy") if shards else []
        lower = " or ".join(["fewer ranks per node"] + unsharded)
        return ("Killed by SIGKILL: `kill -9` from outside, or the kernel's OOM killer (check "
                "`dmesg | grep -i oom`). Host RAM per rank peaks during loading; see run.json "
                "ranks.*.host_peak_rss_mb and `wan-s2v doctor`'s memory plan; "
                f"{lower} lowers it.")
    if crash_stack is not None:
        return ("The process exited or crashed without a Python exception; its Python stack at the "
                f"crash is in {crash_stack}.")
    return ("The process exited or crashed without a Python exception (os._exit, or a native "
            "crash without a Python stack): read its stderr.log under logs/.")


# ----- the failure verdict -----
#: where a :class:`RankFailure` comes from
ERROR_EVENT = "error_event"  # the rank's ``error`` record (it raised)
ERROR_FILE = "error_file"  # only torch elastic's error.json (it raised before writing events)
DEATH = "death"  # its process ended without an ``end`` record and without either of the above

#: an error that says a peer went away sorts this much later than its own time: it is a
#: consequence of the peer's failure, which may have been recorded a little after it
SECONDARY_DELAY_S = 1.0


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure. The first six fields are those of torch elastic's
    ``ProcessFailure`` (``torch.distributed.elastic.multiprocessing.errors``), None where not
    known; the rest are ours."""

    local_rank: Optional[int]
    pid: Optional[int]
    exitcode: Optional[int]  # from torchrun's failure summary; negative: killed by that signal
    error_file: Optional[str]  # the rank's error.json, if torch elastic wrote one
    message: str  # "Type: message" for an exception; how the process ended for a death
    timestamp: float  # when it failed (unix seconds): the error record, error file or exit time
    rank: int  # global rank
    stage: Union[Stage, str]  # the stage it failed in (a plain string: a name this version lacks)
    where: str  # the stage with the clip/step for denoise, for the report
    source: str  # ERROR_EVENT, ERROR_FILE or DEATH
    secondary: bool  # its error says a peer went away: a consequence, not a cause
    hint: Optional[str]
    traceback: Optional[str]  # from its error file

    @property
    def sort_key(self) -> tuple[float, int]:
        """Earlier is more likely the cause; a secondary error counts as 1 s later."""
        return (self.timestamp + (SECONDARY_DELAY_S if self.secondary else 0.0), self.rank)

    def headline(self) -> str:
        """The report's first line when this rank is the cause."""
        if self.source == DEATH:
            return f"rank {self.rank} (pid {self.pid}) {self.message} in stage {self.where}"
        if self.source == ERROR_FILE and self.stage == Stage.START:
            return f"rank {self.rank} failed before its first event: {self.message}"
        return f"rank {self.rank} failed in stage {self.where}: {self.message}"

    def also_line(self) -> str:
        """The report's line for this rank when another one is the cause."""
        if self.source == DEATH:
            return (f"also rank {self.rank} (pid {self.pid}) exited in {self.stage} "
                    f"({describe_exit(self.exitcode)})")
        return (f"also rank {self.rank} in {self.stage}: {first_line(self.message)}"
                + (" (a consequence: a peer went away)" if self.secondary else ""))


def attribute_failures(ranks: Mapping[int, RankState], *, error_files: Mapping[int, ErrorFile],
                       death_times: Mapping[int, float], exit_codes: Mapping[int, int],
                       crash_stacks: Optional[Mapping[int, Path]] = None,
                       spec: Optional[RunSpec] = None) -> list[RankFailure]:
    """Every failed rank, the first failure first (the cause; the others are usually
    consequences). Pure: everything comes from the arguments.

    ``ranks``: global rank -> its events; ``error_files``: global rank -> its torch elastic error
    file (:func:`read_error_files`); ``death_times``: pid -> when that process ended;
    ``exit_codes``: global rank -> exit code from torchrun's summary (:func:`parse_torchrun_exits`);
    ``crash_stacks``: global rank -> its faulthandler dump, for ranks that have one with a Python
    frame. A rank failed when it has an ``error`` record (its time), else an error file (its
    time, whole seconds: a rank that raised before writing events), else when its process ended
    without an ``end`` record (its exit time). Errors saying a peer went away sort
    :data:`SECONDARY_DELAY_S` later. Empty when no rank failed (torchrun itself did).
    """
    crash_stacks = crash_stacks or {}
    found: list[RankFailure] = []
    for rank in sorted(set(ranks) | set(error_files)):
        st = ranks.get(rank)
        ef = error_files.get(rank)
        stage = st.stage if st else Stage.START
        where = f"{stage}{progress_suffix(st) if st else ''}"
        local_rank = st.local_rank if st and st.local_rank is not None else (ef.local_rank if ef else None)
        common = dict(local_rank=local_rank,
                      pid=st.pid if st else None, exitcode=exit_codes.get(rank),
                      error_file=str(ef.path) if ef else None, rank=rank, stage=stage, where=where,
                      traceback=ef.traceback if ef else None)
        if st is not None and st.error:
            msg = f"{st.error.get('error_type')}: {st.error.get('message')}"
            found.append(RankFailure(message=msg, timestamp=float(st.error["t"]), source=ERROR_EVENT,
                                     secondary=is_secondary(msg), hint=hint_for(msg, stage, spec), **common))
        elif ef is not None:
            found.append(RankFailure(message=ef.message, timestamp=float(ef.timestamp), source=ERROR_FILE,
                                     secondary=is_secondary(ef.message),
                                     hint=hint_for(ef.message, stage, spec), **common))
        elif st is not None and st.end is None and st.pid and st.pid in death_times:
            code = exit_codes.get(rank)
            found.append(RankFailure(message=f"died without an error report ({describe_exit(code)})",
                                     timestamp=death_times[st.pid], source=DEATH, secondary=False,
                                     hint=death_hint(code, crash_stacks.get(rank), spec), **common))
    return sorted(found, key=lambda f: f.sort_key)
