"""The context's background thread: liveness pings and deferred release acknowledgements.

One daemon thread per context, started by the heartbeat (``connect(heartbeat=True)``) or
by the first retrieve whose commit is sent without waiting (``transport/releases.py``).
It pings the server for this instance every interval so a live client is never reaped
(doc §3.11), and collects release acknowledgements so a retrieve's session ends promptly
even when the caller goes idle.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref

from lmcache_kv_fast.client.handshake import CONNECT_PROBE_TIMEOUT_S
from lmcache_kv_fast.client.state import SessionState
from lmcache_kv_fast.errors import ContextClosedError, KVCacheSDKError
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.zmq_client import Channel

logger = logging.getLogger(__name__)

#: The background thread collects deferred release acknowledgements this often.
RELEASE_COLLECT_S = 0.01
#: ... and, with none pending, looks again this often (it is also woken when some come).
RELEASE_IDLE_CHECK_S = 0.5


class Background:
    """The background thread of one session (pings, release acknowledgements).

    Args:
        session: The session it works for.
        owner: Weak reference to the context. The running thread holds the context (as a
            thread running one of its methods would): a context whose background thread
            runs is let go by ``close()``, not by the garbage collector.
    """

    def __init__(self, session: SessionState, owner: weakref.ref[object]) -> None:
        self._s = session
        self._owner = owner
        #: Set to stop the thread (for good).
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self._interval: float | None = None
        self._wake = threading.Event()
        self._mutex = threading.Lock()

    def start_heartbeat(self) -> None:
        """Ping every quarter of the server's reap timeout (none when it never reaps)."""
        self._interval = self._heartbeat_interval()
        if self._interval is not None:
            self.ensure()

    def ensure(self) -> None:
        """Start the thread once."""
        with self._mutex:
            if self.thread is not None or self.stop_event.is_set():
                return
            self.thread = threading.Thread(
                target=self._run, args=(self._owner(),),
                name=f"lmcache-kv-fast-bg-{self._s.instance_id:x}", daemon=True,
            )
            self.thread.start()

    def wake(self) -> None:
        """Wake the thread now (releases became pending)."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait (briefly) for it to end."""
        with self._mutex:
            self.stop_event.set()
        self._wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)

    def _heartbeat_interval(self) -> float | None:
        try:
            mp = HttpInfoClient(self._s.http_url, CONNECT_PROBE_TIMEOUT_S).config()["mp"]
            reap = float(mp.get("worker_reap_timeout_seconds", 120.0))
        except (KVCacheSDKError, TypeError, ValueError):
            reap = 120.0
        if reap <= 0:
            return None
        return max(1.0, min(reap / 4.0, 30.0))

    def _run(self, _owner: object) -> None:
        """Ping for liveness every interval; collect deferred release acknowledgements.

        Acknowledgements are collected ``RELEASE_COLLECT_S`` after releases became pending
        (so a retrieve's session ends promptly even when the caller goes idle); callers
        collect them too, whenever they send new ones.
        """
        s = self._s
        zmq_client = s.zmq
        if zmq_client is None:
            return
        interval = self._interval
        next_ping = time.monotonic() + interval if interval is not None else math.inf
        try:
            ch: Channel | None = None
            while True:
                rel = s.releases
                busy = rel is not None and rel.pending()
                timeout = next_ping - time.monotonic()
                if busy:
                    timeout = min(timeout, RELEASE_COLLECT_S)
                elif rel is not None:  # a safety net: look again now and then
                    timeout = min(timeout, RELEASE_IDLE_CHECK_S)
                if timeout > 0:
                    self._wake.wait(None if math.isinf(timeout) else timeout)
                    self._wake.clear()
                if self.stop_event.is_set():
                    return
                if rel is not None and rel.pending():
                    rel.collect()
                if interval is None or time.monotonic() < next_ping:
                    continue
                next_ping = time.monotonic() + interval
                try:
                    ch = ch or zmq_client.channel()
                    ch.call(Op.PING, [s.instance_id], None, min(s.timeout, interval))
                except ContextClosedError:
                    return
                except KVCacheSDKError as err:
                    logger.warning("heartbeat ping to %s failed: %s", s.url, err)
        except ContextClosedError:
            return
