"""Reading a failed or stuck run: exit statuses, torch elastic error files, stack dumps, hints.

Pure functions over the run directory and the ranks' states, used by the launcher's failure and
hang reports (and directly by tests).
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Optional

from wan_s2v_runner.events import LOAD_STAGES, EventReader, RankState, denoise_position, is_secondary
from wan_s2v_runner.spec import RunSpec


def has_frame(path: Path) -> bool:
    try:
        return 'File "' in path.read_text(errors="replace")
    except OSError:
        return False


def progress_suffix(st: RankState) -> str:
    p = st.progress
    if st.stage == "denoise" and p.get("clip"):
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


def read_error_files(run_dir: Path, rank_offset: int = 0, stamps: bool = False) -> dict:
    """global rank -> traceback text from torch elastic's per-rank error.json files
    (``logs/<id>/attempt_<n>/<local_rank>/error.json``; global rank = offset + local rank).
    With ``stamps``: global rank -> the file's timestamp (whole seconds) instead."""
    out: dict = {}
    for ef in (run_dir / "logs").glob("*/attempt_*/*/error.json"):
        try:
            data = json.loads(ef.read_text())
            msg = data.get("message", {})
            if isinstance(msg, dict):
                extra = msg.get("extraInfo", {})
                text = extra.get("py_callstack", "") or msg.get("message", "")
                stamp = int(extra.get("timestamp", 0) or 0)
            else:
                text, stamp = str(msg), int(data.get("timestamp", 0) or 0)
            out[rank_offset + int(ef.parent.name)] = stamp if stamps else text.strip()
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return out


_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME_RE = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)


def analyse_stacks(run_dir: Path, ranks: list[int]) -> list[str]:
    """One line per rank: where its main thread is (top frame), and whether it waits in a
    torch.distributed collective. Ranks *not* in a collective while others wait are the suspects."""
    lines, in_coll, outside = [], [], []
    for r in ranks:
        try:
            text = (run_dir / "stacks" / f"rank{r}.txt").read_text(errors="replace")
        except OSError:
            continue
        blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text) if _FRAME_RE.search(b)]
        main = next((b for b in blocks if "wan_s2v_runner/worker.py" in b or "in <module>" in b), None)
        if main is None:
            continue
        frames = _FRAME_RE.findall(main)
        top = frames[0]
        coll = next((fn for path, _, fn in frames if path.endswith("distributed_c10d.py")), None)
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
    return lines


def tail_lines(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _oom_hint(stage: str, spec: Optional[RunSpec]) -> str:
    mode = spec.mode.value if spec else "?"
    if stage in ("load", "shard", "fingerprint", "engine_import"):
        fix = ("--mode fsdp-fixed (DiT and T5 sharded over the ranks) or --mode hybrid (DiT sharded, "
               "T5 on CPU)" if mode == "ulysses" else
               "--mode hybrid (T5 on CPU) or more ranks" if mode == "fsdp-fixed" else "more ranks")
        return f"GPU out of memory while loading weights ({mode}): try {fix}."
    if stage == "text_encode":
        return f"GPU out of memory in the text encoder ({mode}): --mode hybrid keeps T5 on the CPU."
    if stage in ("decode", "motion_encode", "ref_encode"):
        return ("GPU out of memory in the VAE (every rank decodes the whole clip): a smaller --size "
                "or fewer --infer-frames; --offload-model frees the DiT's memory first.")
    if stage == "denoise":
        return (f"GPU out of memory while denoising ({mode}): --mode hybrid (Ulysses + FSDP DiT) with "
                "more ranks splits both weights and activations; a smaller --size or fewer "
                "--infer-frames shrinks activations.")
    return f"GPU out of memory in {stage} ({mode}): try --mode hybrid, more ranks, or a smaller --size."


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
    ("muxing audio", "The mp4 could not get its audio: check the audio file decodes "
                     "(`wan-s2v doctor --audio ...`)."),
]


def hint_for(text: str, stages: list, spec: Optional[RunSpec] = None) -> Optional[str]:
    if text == "hang":
        if any(s in LOAD_STAGES for s in stages):
            return ("Stuck while starting/loading/encoding: check storage speed, NCCL_P2P_DISABLE=1 on "
                    "consumer GPUs, and that every node reached the rendezvous; raise --watchdog-load "
                    "if loading is just slow.")
        return ("Stuck in a step or collective: read the stack dumps (the rank that is not waiting in "
                "a collective is the one to look at); raise --watchdog-step if steps are just slow.")
    low = text.lower()
    if is_secondary(text):
        return ("This rank lost its connection to a peer: the peer failed or was killed first (if "
                "it is on another node, read that node's run directory).")
    for key, hint in HINTS:
        if key in low:
            return hint if hint is not None else _oom_hint(stages[0] if stages else "?", spec)
    return None
