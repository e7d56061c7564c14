"""Nothing half-written: every file the runner produces appears by ``os.replace`` of a temporary.

One naming rule for temporaries, ``.<stem>.<pid>.<tag><suffix>`` next to the destination (the
suffix is kept so writers that pick a format from it — PIL, ffmpeg — still work), so the
launcher can find and remove what a killed rank left behind (:func:`leftover_pattern`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def temp_name(dest: Path, tag: str = "tmp", pid: int | None = None) -> Path:
    dest = Path(dest)
    return dest.with_name(f".{dest.stem}.{os.getpid() if pid is None else pid}.{tag}{dest.suffix}")


def leftover_pattern(dest: Path, pid: int) -> str:
    """Glob (relative to dest's directory) matching every temporary of ``dest`` made by ``pid``."""
    dest = Path(dest)
    return f".{dest.stem}.{pid}.*{dest.suffix}"


def atomic_write(dest: Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` then rename onto ``dest``; on any error the temporary is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(dest)
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def write_text(dest: Path, text: str) -> Path:
    return atomic_write(dest, lambda p: p.write_text(text, encoding="utf-8"))
