"""The context's background thread: liveness, release acknowledgements, late replies.

One daemon thread per context, started by the heartbeat (``connect(heartbeat=True)``),
by the first retrieve whose commit is sent without waiting (``transport/releases.py``) or
by the first timed-out operation whose late replies must be settled (``client/late.py``).
It

* pings the server for the reader instance every quarter of the reap timeout (the first
  ping is sent at connect, so a client killed before its first interval is reaped too,
  docs/protocol.md §3.11), without ever blocking on the reply;
* re-registers the writer instance every quarter of the registration grace (at most every
  15 minutes): re-registering refreshes its liveness without the ping latch, so an idle
  writer is never reaped while a dead one is reaped only after the grace (see
  ``client/session.py``);
* collects release acknowledgements so a retrieve's session ends promptly even when the
  caller goes idle;
* drives the obligations of timed-out operations as their late replies arrive.

It holds the session, never the context: a context dropped without ``close()`` is
garbage-collected and then closed (``weakref.finalize`` in ``context.py``).
"""

from __future__ import annotations

import logging
import math
import threading
import time

from lmcache_kv_fast.client.handshake import CONNECT_PROBE_TIMEOUT_S
from lmcache_kv_fast.client.late import LATE_POLL_S
from lmcache_kv_fast.client.state import SessionState
from lmcache_kv_fast.errors import ContextClosedError, ServerTimeoutError
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.transport.heartbeat import Beat, ping_interval
from lmcache_kv_fast.transport.zmq_client import Channel

logger = logging.getLogger(__name__)

#: The background thread collects deferred release acknowledgements this often.
RELEASE_COLLECT_S = 0.01
#: ... and, with none pending, looks again this often (it is also woken when some come).
RELEASE_IDLE_CHECK_S = 0.5
#: The writer registration is refreshed at least this often (seconds).
WRITER_REFRESH_MAX_S = 900.0


class Background:
    """The background thread of one session.

    Args:
        session: The session it works for.
    """

    def __init__(self, session: SessionState) -> None:
        self._s = session
        #: Set to stop the thread (for good).
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self._interval: float | None = None
        self._wake = threading.Event()
        self._mutex = threading.Lock()

    def start_heartbeat(self) -> None:
        """Ping now, then every quarter of the server's reap timeout (none if it never reaps).

        The first ping makes the reader ping-proven at once: a client killed before its
        first interval is reaped after the reap timeout, not after the registration grace.
        """
        s = self._s
        self._interval = ping_interval(s.reap_timeout_s)
        if self._interval is None:
            return
        assert s.zmq is not None
        try:
            s.zmq.call(Op.PING, [s.instance_id], None, min(s.timeout, CONNECT_PROBE_TIMEOUT_S))
        except ServerTimeoutError as err:
            logger.warning("the server at %s did not answer the first heartbeat ping: %s",
                           s.url, err)
        self.ensure()

    def ensure(self) -> None:
        """Start the thread once."""
        with self._mutex:
            if self.thread is not None or self.stop_event.is_set():
                return
            self.thread = threading.Thread(
                target=self._run, name=f"lmcache-kv-fast-bg-{self._s.instance_id:x}",
                daemon=True,
            )
            self.thread.start()

    def wake(self) -> None:
        """Wake the thread now (releases became pending)."""
        self._wake.set()

    def kick(self) -> None:
        """Start the thread if needed and wake it (late replies to settle)."""
        self.ensure()
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait (briefly) for it to end."""
        with self._mutex:
            self.stop_event.set()
        self._wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)

    def _writer_refresh_s(self) -> float | None:
        s = self._s
        if not s.writer_registered or s.writer_payload is None or s.reap_timeout_s <= 0:
            return None
        return max(1.0, min(s.registration_grace_s / 4.0, WRITER_REFRESH_MAX_S))

    def _run(self) -> None:
        """Loop until stopped (see the module docstring); never blocks on a reply."""
        try:
            self._loop()
        except ContextClosedError:
            return

    def _loop(self) -> None:
        s = self._s
        zmq_client = s.zmq
        if zmq_client is None:
            return
        interval = self._interval
        refresh = self._writer_refresh_s() if interval is not None else None
        beats: list[Beat] = []
        if interval is not None:
            beats.append(Beat(Op.PING, [s.instance_id], interval, "heartbeat ping", s.url))
        if refresh is not None:
            beats.append(Beat(Op.REGISTER_ENGINE_DRIVEN, [s.writer_payload], refresh,
                              "writer re-registration", s.url))
        ch: Channel | None = None
        while True:
            rel = s.releases
            late = s.late
            timeout = min((b.due_at for b in beats), default=math.inf) - time.monotonic()
            if rel is not None and rel.pending():
                timeout = min(timeout, RELEASE_COLLECT_S)
            elif rel is not None:  # a safety net: look again now and then
                timeout = min(timeout, RELEASE_IDLE_CHECK_S)
            if late.pending():
                late.drive(max(0.0, min(timeout, LATE_POLL_S)))
            elif timeout > 0:
                self._wake.wait(None if math.isinf(timeout) else timeout)
                self._wake.clear()
            if self.stop_event.is_set():
                return
            if rel is not None and rel.pending():
                rel.collect()
            now = time.monotonic()
            for beat in beats:
                if beat.due(now):
                    ch = ch or zmq_client.channel()
                    beat.send(ch, now)
