"""Periodic requests that keep an instance alive on the server, never waiting for the reply.

The server reaps an instance id that was not pinged within its reap timeout
(docs/protocol.md §3.11). A context's background thread (``client/liveness.py``) and each
KV-event subscription (``events/keepalive.py``) keep theirs alive the same way: a
:class:`Beat` sends its request every :func:`ping_interval` seconds on a channel of either
transport (``Channel`` or ``GrpcChannel``) and only looks at the previous beat's reply when
the next one is due, so a slow or dead server never blocks the thread that beats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.protocol.ops import Op

logger = logging.getLogger(__name__)


def ping_interval(reap_timeout_s: float) -> float | None:
    """Seconds between pings: a quarter of the reap timeout, 1..30 s (None: never reaped)."""
    if reap_timeout_s <= 0:
        return None
    return max(1.0, min(reap_timeout_s / 4.0, 30.0))


class Beat:
    """One request sent every ``interval`` seconds; a missing reply is logged, never awaited.

    The first missing reply of a silence is a warning, the next ones (the server is still
    away) are debug messages until a reply comes again.

    Args:
        op: The operation (``PING``, a writer re-registration, ...).
        payloads: Its payloads.
        interval: Seconds between two sends; the first is due ``interval`` from now.
        what: How the log names it (``"heartbeat ping"``).
        url: The server, for the log.
    """

    def __init__(self, op: Op, payloads: Sequence[Any], interval: float, what: str,
                 url: str) -> None:
        self.op = op
        self.payloads = list(payloads)
        self.interval = interval
        self.what = what
        self.url = url
        self.due_at = time.monotonic() + interval
        self._outstanding: Any = None
        self._silent = False

    def due(self, now: float | None = None) -> bool:
        """Whether the next send is due."""
        return (time.monotonic() if now is None else now) >= self.due_at

    def send(self, ch: Any, now: float | None = None) -> None:
        """Look at the previous send's reply (warn when there is none), send again.

        Args:
            ch: A channel of either transport, used by the calling thread only.
            now: ``time.monotonic()`` of the caller's loop (None: read it here).

        Raises:
            ContextClosedError: The channel's client is closed.
        """
        prev, self._outstanding = self._outstanding, None
        if prev is not None:
            if ch.ready(prev):
                self._silent = False
                try:
                    ch.wait(prev, None, 0.0)
                except KVCacheSDKError as err:
                    logger.warning("%s to %s: bad reply: %s", self.what, self.url, err)
            else:
                ch.discard(prev)
                logger.log(logging.DEBUG if self._silent else logging.WARNING,
                           "%s to %s got no reply within %gs", self.what, self.url,
                           time.monotonic() - prev.sent_at)
                self._silent = True
        self._outstanding = ch.send(self.op, self.payloads)
        self.due_at = (time.monotonic() if now is None else now) + self.interval
