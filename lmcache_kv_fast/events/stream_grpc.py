"""The KV-event stream over gRPC (``SubscribeKvEvents``, docs/protocol.md §9, §12).

:func:`~lmcache_kv_fast.events.stream.subscribe` returns a :class:`GrpcKVEventSubscription`
for a target whose URL is ``grpc://`` / ``grpc+unix://``: the same surface as the ZMQ
:class:`~lmcache_kv_fast.events.stream.KVEventSubscription` (iteration, ``poll``,
``cursor``, ``incarnation``, ``active``, ``end_reason``, ``close``, context manager).

The RPC is a server stream (0.5.6 ``ObservabilityService``, 0.5.7 ``KVEventService``): the
server sends each batch as it has one, without the ZMQ stream's per-batch ``ack``; HTTP/2
flow control is the credit. One reader thread drains the stream into a bounded queue (a
slow consumer stops the reader, and the server with it); a lost connection is resubscribed
at the received cursor once the server answers again, and a server restart is surfaced as
``batch.incarnation_changed`` with the stream restarted at cursor 0, as over ZMQ. A ping
thread keeps the subscription's instance id alive against the server's reaper.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError
from lmcache_kv_fast.events.common import KV_EVENT_CAPABILITY, PROBE_TIMEOUT_S
from lmcache_kv_fast.events.endpoint import target_closed
from lmcache_kv_fast.events.keepalive import start_keepalive
from lmcache_kv_fast.events.stream_io import POLL_SLICE_S, KVEventBatch
from lmcache_kv_fast.events.surface import SubscriptionSurface
from lmcache_kv_fast.protocol.constants import INSTANCE_ID_BITS
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.transport import grpc_codec

logger = logging.getLogger("lmcache_kv_fast.events")

#: Batches read ahead of the consumer before the reader (and the server) waits.
_READ_AHEAD = 16
#: Wait between resubscription attempts while the server is unreachable.
_RETRY_S = 0.5


class GrpcKVEventSubscription(SubscriptionSurface):
    """An open ``SubscribeKvEvents`` stream; iterate to get :class:`KVEventBatch` objects.

    Create it with :func:`~lmcache_kv_fast.events.subscribe`. One consumer thread at a
    time; :meth:`close` may be called from any thread.

    Attributes:
        instance_id: The subscription's id on the server.
        model_name: The subscribed model.
        max_events: Records per batch.
        end_reason: Why the stream ended (None while active).
    """

    def __init__(self, target: Any, gen: Generation, *, cursor: int, max_events: int,
                 timeout: float | None, instance_id: int | None) -> None:
        from lmcache_kv_fast.transport.grpc_client import GrpcClient, require_grpc

        self._closed = True  # until everything exists (for __del__)
        self._grpc = require_grpc()
        self._target = target
        self.url: str = target.url
        self.model_name: str = target.model_name
        self.max_events = max_events
        self.instance_id: int = instance_id or (secrets.randbits(INSTANCE_ID_BITS) or 1)
        self.end_reason: str | None = None
        self._timeout = None if timeout is None else float(timeout)
        self._cursor = cursor
        self._incarnation: int | None = None
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(_READ_AHEAD)
        self._stop = threading.Event()
        self._ended = False
        self._call: Any = None
        self._lock = threading.Lock()
        probe = min(PROBE_TIMEOUT_S, float(getattr(target, "timeout", PROBE_TIMEOUT_S)))
        self._client = GrpcClient(self.url, gen, probe)
        self._method = self._client.dialect.method(Op.SUBSCRIBE_KV_EVENTS)
        self._closed = False
        try:
            self._check_capability(gen, probe)
            self._reader = threading.Thread(
                target=self._read_loop, args=(cursor,), daemon=True,
                name=f"lmcache-kv-fast-events-grpc-{self.instance_id:x}")
            self._reader.start()
            self._first = self._next(probe)
            if self._first is None:
                raise KVCacheSDKError(
                    f"SubscribeKvEvents on {self.url} got no first batch within {probe:g}s "
                    "(the server sends one at once; see its log)")
            self._pinger = start_keepalive(self, self._client, target, self._stop)
        except BaseException:
            self.close()
            raise
        logger.info("subscribed to KV events of %r on %s over gRPC (instance %d, cursor %d)",
                    self.model_name, self.url, self.instance_id, cursor)

    def _check_capability(self, gen: Generation, probe: float) -> None:
        caps = self._client.call(Op.GET_EXPERIMENTAL, (), list[str], probe)
        if gen.events_capability and KV_EVENT_CAPABILITY not in caps:
            raise KVCacheSDKError(
                f"the LMCache server at {self.url} does not record KV events (get_experimental "
                f"= {caps!r}); start it without --kv-event-log-size 0 and without "
                "--disable-observability")

    # ------------------------------------------------------------------ the reader
    def _read_loop(self, cursor: int) -> None:
        """Read batches into the queue; resubscribe after a lost connection."""
        st = _ReadState(cursor)
        while not self._stop.is_set():
            try:
                with contextlib.closing(self._stream(st.cursor)) as stream:
                    if self._read(stream, st):
                        continue  # resubscribe (a restarted server: from cursor 0)
                self._put(("end", "the server ended the stream (a newer subscription with "
                                  "the same instance_id, the reaper, or KV events disabled)"))
                return
            except self._grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if err.code() != self._grpc.StatusCode.UNAVAILABLE:
                    self._put(("error", self._client.rpc_error(Op.SUBSCRIBE_KV_EVENTS, err)))
                    return
                logger.warning("KV event stream: lost the connection to %s; resubscribing "
                               "at cursor %d when it is back", self.url, st.cursor)
                st.resync = True
                self._stop.wait(_RETRY_S)
            except KVCacheSDKError as err:  # a malformed batch
                self._put(("error", err))
                return

    def _read(self, stream: Iterator[KVEventBatch], st: _ReadState) -> bool:
        """Queue ``stream``'s batches; True when it must be resubscribed."""
        for batch in stream:
            changed = st.incarnation is not None and batch.incarnation != st.incarnation
            if st.resync:  # the first batch after a reconnection
                st.resync = False
                if changed and st.cursor != 0:
                    logger.warning("KV event stream: the server at %s restarted (incarnation "
                                   "%d -> %d); restarting the stream at cursor 0", self.url,
                                   st.incarnation, batch.incarnation)
                    st.cursor = 0
                    return True
                if not changed and not batch.events and not batch.lost and batch.enabled:
                    st.cursor = batch.next_cursor
                    continue  # the same server and nothing new: nothing to surface
            batch.incarnation_changed = changed
            st.incarnation, st.cursor = batch.incarnation, batch.next_cursor
            self._put(("batch", batch))
            if self._stop.is_set():
                break
        return False

    def _stream(self, cursor: int) -> Iterator[KVEventBatch]:
        request = self._method.encode([self.instance_id, self.model_name, cursor,
                                       self.max_events])
        call = self._client.stub(self._method)(request, wait_for_ready=True)
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
        try:
            for msg in call:
                yield grpc_codec.to_type(self._method.decode(msg), KVEventBatch,
                                         "subscribe_kv_events")
        finally:
            call.cancel()  # a stream given up (resubscription, close) ends on the server

    def _put(self, item: tuple[str, Any]) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=POLL_SLICE_S)
                return

    def _next(self, timeout: float | None) -> KVEventBatch | None:
        first = getattr(self, "_first", None)
        if first is not None:
            self._first = None
            return self._take(first)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closed and not self._ended:
            if target_closed(self._target) or (self._stop.is_set() and self._queue.empty()):
                self.end_reason = self.end_reason or "the SDK context was closed"
                self.close()
                break
            wait = POLL_SLICE_S if deadline is None else \
                min(POLL_SLICE_S, deadline - time.monotonic())
            try:
                kind, value = self._queue.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            if kind == "batch":
                return self._take(value)
            self._ended = True
            self.end_reason = str(value)
            self.close()
            if kind == "error":
                raise value if isinstance(value, KVCacheSDKError) else ProtocolError(str(value))
        return None

    def _take(self, batch: KVEventBatch) -> KVEventBatch:
        self._cursor = batch.next_cursor
        self._incarnation = batch.incarnation
        if not batch.enabled:
            logger.warning("the LMCache server at %s reports KV events disabled", self.url)
        return batch

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = 1.0) -> None:
        """Cancel the stream and stop the threads. Idempotent.

        Args:
            timeout: Seconds to wait for the threads to stop.
        """
        if self._closed:
            return
        self._closed = True
        if self.end_reason is None:
            self.end_reason = "closed by the client"
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()  # the server's stream is closed with the RPC
        for name in ("_reader", "_pinger"):
            th = getattr(self, name, None)
            if th is not None and th is not threading.current_thread():
                th.join(timeout)
        self._client.close()

class _ReadState:
    """The reader's position: cursor to resubscribe at, last incarnation, resync pending."""

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor
        self.incarnation: int | None = None
        self.resync = False
