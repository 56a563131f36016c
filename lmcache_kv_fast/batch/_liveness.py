"""Fail fast on a dead server: after an item's failure, one liveness ping.

A server that was killed or frozen never answers, so every item of a batch would pay the
full ``timeout`` (24 items at ``timeout=2``: 48 s; 1,000 items at the default 60 s: ~17
hours). :class:`ServerWatch` is asked after an item failed with a server error: it pings
the server once (at most ``min(timeout, 5 s)``); when that gets no answer (or the server
no longer knows this client) the server is *gone* and the engine stops: nothing more is
sent, items not started are reported ``not_attempted``, the batch raises
:class:`~lmcache_kv_fast.errors.ServerUnavailableError`. Concurrent failures share one
ping (the others wait for its verdict); a server that answers changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time

from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.errors import (
    ContextClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
    ServerUnavailableError,
)

logger = logging.getLogger("lmcache_kv_fast.batch")

#: Errors that say nothing about the server (bad input, closed context): no ping.
_NOT_THE_SERVER = (InvalidArgumentError, InvalidTypeError, ContextClosedError)


class ServerWatch:
    """Whether the server of ``ctx`` is gone, checked with one ping after a failure.

    Args:
        ctx: The context the batch runs on.
        hold_s: How long a "gone" verdict stands (None: for good — a batch stops; a
            long-lived engine re-checks after this many seconds, in case the server
            came back).
    """

    def __init__(self, ctx: LMCacheKVCacheContext, hold_s: float | None = None) -> None:
        self.ctx = ctx
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._gone: ServerUnavailableError | None = None
        self._gone_at = 0.0
        self.pings = 0

    def gone(self) -> ServerUnavailableError | None:
        """The error to stop with, when the server was found gone (and the verdict stands)."""
        err = self._gone
        if err is not None and self.hold_s is not None and \
                time.monotonic() - self._gone_at > self.hold_s:
            return None
        return err

    def after_failure(self, err: BaseException) -> bool:
        """Called after an item failed with ``err``; True when the server is gone.

        Server errors (timeouts, a lost connection, a server that forgot this client) lead
        to one ping; argument errors and a closed context do not.
        """
        if not isinstance(err, KVCacheSDKError) or isinstance(err, _NOT_THE_SERVER):
            return False
        if self.gone() is not None:
            return True
        with self._lock:  # one ping at a time; a failure meanwhile takes its verdict
            if self.gone() is not None:
                return True
            if self.ctx.closed:
                return False
            why = ""
            self.pings += 1
            t0 = time.monotonic()
            try:
                if not self.ctx.ping():
                    why = "it answered the ping with False (it does not know this client)"
            except ContextClosedError:
                return False
            except KVCacheSDKError as perr:
                why = f"{type(perr).__name__}: {perr}"
            if not why:
                logger.info("batch: an item failed (%s: %.200s) but the server answered a ping "
                            "in %.3fs; going on", type(err).__name__, err, time.monotonic() - t0)
                return False
            self._gone = ServerUnavailableError(
                f"the LMCache server at {self.ctx.url} is unavailable: an item failed "
                f"({type(err).__name__}: {str(err)[:300]}) and a liveness ping got no answer "
                f"({why[:300]}); the batch stopped, items not started are reported as not "
                "attempted"
            )
            self._gone_at = time.monotonic()
            logger.warning("batch: %s", self._gone)
            return True
