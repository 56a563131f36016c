"""The progress display of long batch phases: a tqdm bar when installed, else log lines.

One class for ``batch`` (sequences) and the ``sdk`` batched stream (streams): a bar on a
terminal when tqdm is installed; otherwise an INFO line every ~5 s and at the end.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

logger = logging.getLogger("lmcache_kv_fast.progress")

__all__ = ["Progress"]

_LOG_EVERY_S = 5.0


def _on_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Progress:
    """Counts finished items of one phase.

    Args:
        total: Items in the phase (None: not known, an iterator).
        desc: Phase name, shown before the count.
        enabled: Show anything at all.
        unit: What an item is called ("seq", "stream").
    """

    def __init__(self, total: int | None, desc: str, enabled: bool, unit: str = "seq") -> None:
        self.total, self.desc, self.enabled, self.unit = total, desc, enabled, unit
        self.n = 0
        self._last = time.monotonic()
        self._bar: Any = None
        if enabled and _on_terminal():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False)

    def update(self, k: int = 1) -> None:
        """``k`` more items finished."""
        self.n += k
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(k)
        elif time.monotonic() - self._last >= _LOG_EVERY_S or self.n == self.total:
            self._last = time.monotonic()
            logger.info("%s: %d/%s %ss", self.desc, self.n, self.total or "?", self.unit)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
