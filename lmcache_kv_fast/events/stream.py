"""The server's KV-event stream: :func:`subscribe` and :class:`KVEventSubscription`.

:func:`subscribe` opens the server's credit-based ``subscribe_kv_events`` stream (docs/protocol.md
§2.6, §9) on a DEALER socket of its own and returns a :class:`KVEventSubscription`, an
iterator of typed :class:`~lmcache_kv_fast.events.stream_io.KVEventBatch` objects. Each
batch is acknowledged when the consumer asks for the next one (the server sends the next
batch only after that ack); a ``ping`` thread keeps the subscription alive against the
server's reaper; a lost connection is resumed at the cursor; a server restart is surfaced
as ``batch.incarnation_changed`` (and the stream restarts from cursor 0 of the new server).
The wire work lives in :mod:`lmcache_kv_fast.events.stream_io`, the ping thread in
:mod:`lmcache_kv_fast.events.keepalive`; the sockets are ``transport/``'s.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import zmq

from lmcache_kv_fast.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
)
from lmcache_kv_fast.events.common import PROBE_TIMEOUT_S
from lmcache_kv_fast.events.endpoint import check_seconds, check_target, target_closed
from lmcache_kv_fast.events.keepalive import start_keepalive
from lmcache_kv_fast.events.stream_grpc import GrpcKVEventSubscription
from lmcache_kv_fast.events.stream_io import (
    POLL_SLICE_S,
    KVEventBatch,
    StreamIO,
    WireState,
    stream_control,
)
from lmcache_kv_fast.events.surface import SubscriptionSurface
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.constants import (
    INSTANCE_ID_BITS,
    MAX_EVENTS_PER_BATCH,
    STREAM_ACK,
    STREAM_CANCEL,
)
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.transport.urls import GRPC_SCHEMES
from lmcache_kv_fast.transport.zmq_client import ZmqClient
from lmcache_kv_fast.transport.zmq_socket import STREAM_OPTIONS, Dealer

logger = logging.getLogger("lmcache_kv_fast.events")

#: close() waits this long for the server's end marker after ``cancel``.
DEFAULT_CLOSE_TIMEOUT_S = 1.0
#: The stream watches its connection: resubscribe after a disconnect, once reconnected.
_STREAM_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def subscribe(ctx: Any, *, cursor: int = 0, max_events: int = MAX_EVENTS_PER_BATCH,
              timeout: float | None = None, instance_id: int | None = None
              ) -> KVEventSubscription | GrpcKVEventSubscription:
    """Subscribe to the server's KV events of ``ctx.model_name``.

    Args:
        ctx: An :class:`~lmcache_kv_fast.client.context.LMCacheKVCacheContext` or an
            :class:`EventsEndpoint` (anything with ``url``, ``http_url``, ``model_name``,
            ``generation``; ``closed`` and ``timeout`` are honoured when present).
        cursor: Last server ``seq`` already processed; 0 replays the retained log from the
            beginning. Resume a previous subscription with its ``cursor`` attribute.
        max_events: Records per batch, 1..1024.
        timeout: None: iteration blocks until a batch arrives (waking every 0.1 s to notice
            closing). A number: ``next()`` raises :class:`KVEventTimeout` after that many
            seconds without a batch; the subscription stays open and iteration may go on.
        instance_id: Subscription id; default a random 63-bit id. A new subscription with
            the same id replaces the old one on the server (the old one then stops).

    Returns:
        An open :class:`KVEventSubscription` (a :class:`GrpcKVEventSubscription` with the
        same surface when ``ctx.url`` is a gRPC URL, docs/protocol.md §12) whose first
        batch (the server's status batch, possibly without events) has already arrived.

    Raises:
        InvalidArgumentError: Bad ``cursor``/``max_events``/``timeout``/``instance_id``
            (nothing is sent).
        KVCacheSDKError: The server has no KV-event stream (older than 0.5.6, or events
            disabled), or it did not answer.
        ContextClosedError: ``ctx`` is closed.
        MissingExtraError: A gRPC URL without grpcio installed.
    """
    url = getattr(ctx, "url", None)
    if isinstance(url, str) and url.partition("://")[0] in GRPC_SCHEMES:
        _check_subscribe_args(cursor, max_events, timeout, instance_id)
        gen = _stream_generation(ctx)
        check_target(ctx)
        return GrpcKVEventSubscription(ctx, gen, cursor=cursor, max_events=max_events,
                                       timeout=timeout, instance_id=instance_id)
    return KVEventSubscription(ctx, cursor=cursor, max_events=max_events, timeout=timeout,
                               instance_id=instance_id)


def _stream_generation(target: Any) -> Generation:
    """The target's generation, refused unless it has the KV-event stream.

    Raises:
        KVCacheSDKError: Older than 0.5.6 (or no generation at all).
    """
    gen: Generation | None = getattr(target, "generation", None)
    if not isinstance(gen, Generation) or not gen.supports(Op.SUBSCRIBE_KV_EVENTS) \
            or not gen.supports(Op.GET_EXPERIMENTAL):
        name = gen.name if isinstance(gen, Generation) else "unknown"
        raise KVCacheSDKError(
            f"the LMCache server at {getattr(target, 'url', '?')} (generation {name}) has "
            "no KV-event stream: subscribe_kv_events exists from LMCache 0.5.6 on"
        )
    return gen


def _check_subscribe_args(cursor: Any, max_events: Any, timeout: Any, instance_id: Any) -> None:
    if type(cursor) is not int:
        raise InvalidTypeError(f"cursor must be an int, got {type(cursor).__name__}")
    if cursor < 0:
        raise InvalidArgumentError(f"cursor must be >= 0, got {cursor}")
    if type(max_events) is not int:
        raise InvalidTypeError(f"max_events must be an int, got {type(max_events).__name__}")
    if not 1 <= max_events <= MAX_EVENTS_PER_BATCH:
        raise InvalidArgumentError(
            f"max_events must be in [1, {MAX_EVENTS_PER_BATCH}], got {max_events}"
        )
    if timeout is not None:
        check_seconds(timeout, "timeout")
    if instance_id is not None and (type(instance_id) is not int or
                                    not 0 < instance_id < (1 << INSTANCE_ID_BITS)):
        raise InvalidArgumentError(
            f"instance_id must be an int in [1, 2**{INSTANCE_ID_BITS}), got {instance_id!r}"
        )


class KVEventSubscription(StreamIO, SubscriptionSurface):
    """An open ``subscribe_kv_events`` stream (docs/protocol.md §2.6, §9); iterate to get batches.

    Create it with :func:`subscribe`. Iteration yields :class:`KVEventBatch` objects and
    acknowledges each one when the next is requested (credit-based: the server sends the
    next batch only after the ack). Use one consumer thread at a time; :meth:`close` may be
    called from any thread.

    Closing (:meth:`close`, leaving a ``with`` block, garbage collection, or closing the
    context it was created from) sends ``cancel`` and waits briefly for the server's end
    marker. Iteration then stops.

    Resilience:

    * A ``ping(instance_id)`` thread keeps the subscription alive against the server's
      reaper (docs/protocol.md §3.11).
    * When the connection drops, the stream is re-subscribed at the received cursor once
      the socket reconnects. If the server's ``incarnation`` changed (restart), the stream
      restarts at cursor 0 of the new server and the next batch has
      ``incarnation_changed=True``; a reconnect to the same server is invisible.
    * When the server ends the stream (a newer subscription with the same ``instance_id``,
      the reaper, or events disabled), iteration stops and :attr:`end_reason` says why.

    Attributes:
        instance_id: The subscription's id on the server.
        model_name: The subscribed model.
        max_events: Records per batch.
        end_reason: Why the stream ended (None while active).
    """

    def __init__(self, target: Any, *, cursor: int = 0, max_events: int = MAX_EVENTS_PER_BATCH,
                 timeout: float | None = None, instance_id: int | None = None) -> None:
        self._closed = self._finished = True  # until the sockets exist (for __del__)
        _check_subscribe_args(cursor, max_events, timeout, instance_id)
        gen = _stream_generation(target)
        check_target(target)
        self._init_state(target, gen, cursor, max_events, timeout, instance_id)
        probe = min(PROBE_TIMEOUT_S, float(getattr(target, "timeout", PROBE_TIMEOUT_S)))
        # The control client carries the pings; the stream has a DEALER of its own.
        self._client = ZmqClient(self.url, gen, probe)
        self._closed = self._finished = False
        try:
            self._conn = Dealer(self._client.zmq_context, self._client.endpoint,
                                options=STREAM_OPTIONS, events=_STREAM_EVENTS)
            with self._lock:
                self._open(cursor, probe)
            self._pinger = start_keepalive(self, self._client, target, self._stop)
        except BaseException:
            self.close(timeout=0.2)
            raise
        logger.info("subscribed to KV events of %r on %s (instance %d, cursor %d)",
                    self.model_name, self.url, self.instance_id, cursor)

    def _init_state(self, target: Any, gen: Generation, cursor: int, max_events: int,
                    timeout: float | None, instance_id: int | None) -> None:
        """The subscription's identity, what its user sees, its threads' and the wire's state."""
        self._target = target
        self._gen = gen
        self.url: str = target.url
        self.model_name: str = target.model_name
        self.max_events = max_events
        self.instance_id: int = instance_id or (secrets.randbits(INSTANCE_ID_BITS) or 1)
        self._op_frame = codec.encode(gen.op_frame_value(Op.SUBSCRIBE_KV_EVENTS))
        # what SubscriptionSurface shows
        self._timeout = None if timeout is None else float(timeout)
        self._cursor = cursor
        self._incarnation: int | None = None
        self._ended = False
        self._error: KVCacheSDKError | None = None
        self.end_reason: str | None = None
        # threads and closing
        self._lock = threading.RLock()
        self._finish_lock = threading.Lock()
        self._stop = threading.Event()
        self._close_requested = False
        self._pinger: threading.Thread | None = None
        self._conn: Dealer | None = None
        self._w = WireState(sent_cursor=cursor, recv_cursor=cursor)

    def _next(self, timeout: float | None) -> KVEventBatch | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        error: KVCacheSDKError | None = None
        result: KVEventBatch | None = None
        pumped = False
        with self._lock:
            while True:
                if self._closed:
                    break
                if self._close_requested or target_closed(self._target):
                    if not self._close_requested:
                        self.end_reason = "the SDK context was closed"
                    self._shutdown_locked(DEFAULT_CLOSE_TIMEOUT_S)
                    break
                try:
                    self._ack_if_due()
                    if self._w.pending is not None:
                        result = self._take()
                        break
                    if self._error is not None:
                        error = self._error
                        self._shutdown_locked(DEFAULT_CLOSE_TIMEOUT_S)
                        break
                    if self._ended:
                        self._shutdown_locked(DEFAULT_CLOSE_TIMEOUT_S)
                        break
                    wait = POLL_SLICE_S
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            if pumped:
                                break
                            wait = 0.0
                    self._pump(wait)
                    pumped = True
                except zmq.ZMQError as err:
                    error = KVCacheSDKError(f"KV event stream socket failed: {err}")
                    self.end_reason = str(error)
                    self._shutdown_locked(0.0)
                    break
        if self._closed:
            self._finish()
        if error is not None:
            raise error
        return result

    def _take(self) -> KVEventBatch:
        assert self._w.pending is not None
        uid, batch = self._w.pending
        self._w.pending = None
        self._w.unacked_uid = uid
        self._cursor = batch.next_cursor
        self._incarnation = batch.incarnation
        return batch

    def _ack_if_due(self) -> None:
        if self._w.unacked_uid is not None:
            if self._w.unacked_uid == self._w.stream_uid and not self._ended:
                self._send(stream_control(self._w.unacked_uid, STREAM_ACK))
            self._w.unacked_uid = None

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Cancel the stream and release the sockets and threads. Idempotent.

        Args:
            timeout: Seconds to wait for the server's end marker after ``cancel``.
        """
        if not self._closed and self.end_reason is None:
            self.end_reason = "closed by the client"
        self._close_requested = True
        with self._lock:
            if not self._closed:
                self._shutdown_locked(timeout)
        self._finish()

    def _shutdown_locked(self, timeout: float) -> None:
        if self._closed:
            return
        self._stop.set()
        try:
            if self._w.stream_uid is not None and not self._ended and self._error is None:
                self._w.cancelling = True
                self._send(stream_control(self._w.stream_uid, STREAM_CANCEL))
                deadline = time.monotonic() + timeout
                while not self._w.cancel_done and (left := deadline - time.monotonic()) > 0:
                    self._pump(min(left, POLL_SLICE_S))
                if not self._w.cancel_done:
                    logger.debug("no end marker from %s within %gs after cancel", self.url,
                                 timeout)
        except zmq.ZMQError as err:
            logger.debug("cancel of the KV event stream failed: %s", err)
        finally:
            self._closed = True
            self._w.pending = None
            if self._conn is not None:
                self._conn.close()

    def _finish(self) -> None:
        with self._finish_lock:
            if self._finished or not self._closed:
                return
            self._finished = True
        pinger = self._pinger
        if pinger is not None and pinger is not threading.current_thread():
            pinger.join(timeout=5.0)
            if pinger.is_alive():  # pragma: no cover - never seen
                logger.warning("KV event ping thread did not stop; leaving its ZMQ context")
                return
        self._client.close()
