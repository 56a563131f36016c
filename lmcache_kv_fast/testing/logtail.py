"""The tail of a child process's log file (for error messages). Standard library only."""

from __future__ import annotations

from pathlib import Path

__all__ = ["log_tail"]


def log_tail(path: Path | None, n: int) -> str:
    """The last ``n`` lines of the file at ``path``; ``""`` when there is none."""
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
