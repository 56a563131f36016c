"""A progress bar for the long phases of a batched stream (tqdm when installed).

Without tqdm, or when stderr is not a terminal, a log line every ~5 s says how many
streams are done. ``progress=None`` (the batch's default) shows a bar only on a
terminal and only for batches of at least :data:`AUTO_MIN_STREAMS` streams.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("lmcache_kv_fast.sdk")

__all__ = ["AUTO_MIN_STREAMS", "Progress", "want_progress"]

#: ``progress=None`` shows a bar from this many streams on (on a terminal).
AUTO_MIN_STREAMS = 8
_LOG_EVERY_S = 5.0


def want_progress(progress: bool | None, n: int) -> bool:
    """Whether to show progress for ``n`` streams (``None``: terminal and enough streams)."""
    if progress is None:
        return n >= AUTO_MIN_STREAMS and bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


class Progress:
    """Counts finished streams; a tqdm bar or periodic log lines.

    Args:
        total: Streams in the phase.
        desc: Phase name.
        enabled: Show anything at all.
    """

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.n = 0
        self._last = time.monotonic()
        self._bar = None
        if enabled and getattr(sys.stderr, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="stream", leave=False)

    def update(self, k: int = 1) -> None:
        """``k`` more streams finished."""
        self.n += k
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(k)
        elif time.monotonic() - self._last >= _LOG_EVERY_S or self.n == self.total:
            self._last = time.monotonic()
            logger.info("%s: %d/%d streams", self.desc, self.n, self.total)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
