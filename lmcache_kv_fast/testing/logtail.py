"""Excerpts of a child process's log file (for error messages). Standard library only."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["log_errors", "log_tail"]

#: Lines that start an error report in a vLLM / LMCache / Python log.
_ERROR_START = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|\bCRITICAL\b|"
                          r"EngineDeadError|AssertionError|Fatal Python error")


def _lines(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return []
    return path.read_text(errors="replace").splitlines()


def log_tail(path: Path | None, n: int, drop: tuple[str, ...] = ()) -> str:
    """The last ``n`` lines of the file at ``path``.

    Lines that contain one of ``drop`` are left out; ``""`` when there is no file.
    """
    lines = [ln for ln in _lines(path) if not any(d in ln for d in drop)]
    return "\n".join(lines[-n:])


def log_errors(path: Path | None, n: int = 120, context: int = 40) -> str:
    """The log's error reports, wherever they are.

    Every line that starts one (a traceback, an ``ERROR`` line) with the ``context`` lines
    after it, overlapping windows merged, at most ``n`` lines (the first ones: the root
    cause comes first); ``""`` when there is none.

    A dead engine's traceback is often far from the log's end (the API server keeps
    logging its shutdown), so a tail alone can miss it.
    """
    lines = _lines(path)
    keep: list[int] = []
    until = -1
    for i, ln in enumerate(lines):
        if _ERROR_START.search(ln):
            until = max(until, i + context)
        if i <= until:
            keep.append(i)
    out: list[str] = []
    prev = -2
    for i in keep[:n]:
        if i != prev + 1 and out:
            out.append("[...]")
        out.append(lines[i])
        prev = i
    return "\n".join(out)
