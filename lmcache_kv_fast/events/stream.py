"""The server's KV-event stream: :func:`subscribe` and :class:`KVEventSubscription`.

:func:`subscribe` opens the server's credit-based ``subscribe_kv_events`` stream (docs/protocol.md
§2.6, §9) on a DEALER socket of its own and returns a :class:`KVEventSubscription`, an
iterator of typed :class:`~lmcache_kv_fast.events.stream_io.KVEventBatch` objects. Each
batch is acknowledged when the consumer asks for the next one (the server sends the next
batch only after that ack); a ``ping`` thread keeps the subscription alive against the
server's reaper; a lost connection is resumed at the cursor; a server restart is surfaced
as ``batch.incarnation_changed`` (and the stream restarts from cursor 0 of the new server).
The socket work lives in :mod:`lmcache_kv_fast.events.stream_io`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import weakref
from typing import Any

import zmq

from lmcache_kv_fast.errors import (
    ContextClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
)
from lmcache_kv_fast.events.common import _PROBE_TIMEOUT_S
from lmcache_kv_fast.events.endpoint import (
    _check_seconds,
    _ping_interval,
    _target_closed,
    _target_reap_timeout,
)
from lmcache_kv_fast.events.stream_grpc import GrpcKVEventSubscription, check_target
from lmcache_kv_fast.events.stream_io import (
    _POLL_SLICE_S,
    _UIDS,
    KVEventBatch,
    _StreamIO,
    send_stream_control,
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
from lmcache_kv_fast.transport.zmq_client import connect_socket

logger = logging.getLogger("lmcache_kv_fast.events")

#: The ping thread wakes this often (it also watches the context).
_PINGER_SLICE_S = 0.1
#: close() waits this long for the server's end marker after ``cancel``.
DEFAULT_CLOSE_TIMEOUT_S = 1.0
#: ZMTP heartbeats on the stream socket detect a silently dead server (ms).
_HEARTBEAT_IVL_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 6000


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
        _check_seconds(timeout, "timeout")
    if instance_id is not None and (type(instance_id) is not int or
                                    not 0 < instance_id < (1 << INSTANCE_ID_BITS)):
        raise InvalidArgumentError(
            f"instance_id must be an int in [1, 2**{INSTANCE_ID_BITS}), got {instance_id!r}"
        )


class KVEventSubscription(_StreamIO, SubscriptionSurface):
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
        self._closed = True  # until the socket exists (for __del__)
        self._finished = True
        _check_subscribe_args(cursor, max_events, timeout, instance_id)
        gen = _stream_generation(target)
        check_process = getattr(target, "_check_process", None)
        if check_process is not None:  # a context made before fork(): refused here at once
            check_process()
        if _target_closed(target):
            raise ContextClosedError(f"the SDK context for {target.url} is closed")
        self._target = target
        self._gen = gen
        self.url: str = target.url
        self.model_name: str = target.model_name
        self.max_events = max_events
        self.instance_id: int = instance_id or (secrets.randbits(INSTANCE_ID_BITS) or 1)
        self._timeout = None if timeout is None else float(timeout)
        probe = min(_PROBE_TIMEOUT_S, float(getattr(target, "timeout", _PROBE_TIMEOUT_S)))

        self._lock = threading.RLock()
        self._finish_lock = threading.Lock()
        self._stop = threading.Event()
        self._close_requested = False
        self._op_frame = codec.encode(gen.op_frame_value(Op.SUBSCRIBE_KV_EVENTS))
        self._stream_uid: bytes | None = None
        self._sent_cursor = cursor
        self._check_resync = False
        self._need_resubscribe = False
        self._pending: tuple[bytes, KVEventBatch] | None = None
        self._unacked_uid: bytes | None = None
        self._last_incarnation: int | None = None
        self._recv_cursor = cursor
        self._cursor = cursor
        self._incarnation: int | None = None
        self._ended = False
        self._cancelling = False
        self._cancel_done = False
        self._error: KVCacheSDKError | None = None
        self._call_uid: bytes | None = None
        self._call_reply: list[bytes] | None = None
        self.end_reason: str | None = None
        self._pinger: threading.Thread | None = None

        self._zctx = zmq.Context(io_threads=1)
        self._sock = self._zctx.socket(zmq.DEALER)
        self._closed = False
        self._finished = False
        try:
            for opt, val in ((zmq.LINGER, 0), (zmq.RECONNECT_IVL, 100),
                             (zmq.RECONNECT_IVL_MAX, 1000),
                             (zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS),
                             (zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)):
                self._sock.setsockopt(opt, val)
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._poller = zmq.Poller()
            self._poller.register(self._sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
            connect_socket(self._sock, self.url)
            with self._lock:
                self._check_capability(probe)
                self._send_subscribe(cursor)
                deadline = time.monotonic() + probe
                while self._pending is None and not self._ended and self._error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise KVCacheSDKError(
                            f"subscribe_kv_events on {self.url} got no first batch within "
                            f"{probe:g}s (the server sends one at once; see its log)"
                        )
                    self._pump(min(left, _POLL_SLICE_S))
                if self._error is not None:
                    raise self._error
            interval = _ping_interval(_target_reap_timeout(target))
            # The thread holds only a weak reference: a subscription dropped without
            # close() is garbage-collected and then closes itself (__del__).
            self._pinger = threading.Thread(
                target=_ping_loop, args=(weakref.ref(self), self._zctx, self._stop, target,
                                         interval), daemon=True,
                name=f"lmcache-kv-fast-events-{self.instance_id:x}",
            )
            self._pinger.start()
        except BaseException:
            self.close(timeout=0.2)
            raise
        logger.info("subscribed to KV events of %r on %s (instance %d, cursor %d)",
                    self.model_name, self.url, self.instance_id, cursor)

    def _next(self, timeout: float | None) -> KVEventBatch | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        error: KVCacheSDKError | None = None
        result: KVEventBatch | None = None
        pumped = False
        with self._lock:
            while True:
                if self._closed:
                    break
                if self._close_requested or _target_closed(self._target):
                    if not self._close_requested:
                        self.end_reason = "the SDK context was closed"
                    self._shutdown_locked(DEFAULT_CLOSE_TIMEOUT_S)
                    break
                try:
                    self._ack_if_due()
                    if self._pending is not None:
                        result = self._take()
                        break
                    if self._error is not None:
                        error = self._error
                        self._shutdown_locked(DEFAULT_CLOSE_TIMEOUT_S)
                        break
                    if self._ended:
                        self._shutdown_locked(DEFAULT_CLOSE_TIMEOUT_S)
                        break
                    wait = _POLL_SLICE_S
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
        assert self._pending is not None
        uid, batch = self._pending
        self._pending = None
        self._unacked_uid = uid
        self._cursor = batch.next_cursor
        self._incarnation = batch.incarnation
        return batch

    def _ack_if_due(self) -> None:
        if self._unacked_uid is not None:
            if self._unacked_uid == self._stream_uid and not self._ended:
                send_stream_control(self._sock, self._unacked_uid, STREAM_ACK)
            self._unacked_uid = None

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
            if self._stream_uid is not None and not self._ended and self._error is None:
                self._cancelling = True
                send_stream_control(self._sock, self._stream_uid, STREAM_CANCEL)
                deadline = time.monotonic() + timeout
                while not self._cancel_done and (left := deadline - time.monotonic()) > 0:
                    self._pump(min(left, _POLL_SLICE_S))
                if not self._cancel_done:
                    logger.debug("no end marker from %s within %gs after cancel", self.url,
                                 timeout)
        except zmq.ZMQError as err:
            logger.debug("cancel of the KV event stream failed: %s", err)
        finally:
            self._closed = True
            self._pending = None
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            with contextlib.suppress(AttributeError, zmq.ZMQError):
                self._monitor.close(linger=0)
            with contextlib.suppress(zmq.ZMQError):
                self._sock.close(linger=0)

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
        self._zctx.term()

def _ping_loop(ref: weakref.ref[KVEventSubscription], zctx: zmq.Context,
               stop: threading.Event, target: Any, interval: float | None) -> None:
    """Ping the subscription's instance id; close the subscription when ``target`` closes."""
    sub = ref()
    if sub is None:
        return
    url, instance_id = sub.url, sub.instance_id
    ping_op = codec.encode(sub._gen.op_frame_value(Op.PING))
    del sub
    payload = codec.encode(instance_id)
    sock = zctx.socket(zmq.DEALER)
    close_target = False
    try:
        sock.setsockopt(zmq.LINGER, 0)
        connect_socket(sock, url)
        next_ping = time.monotonic() + (interval or 0.0)
        last_pong = time.monotonic()
        warned = False
        while not stop.wait(_PINGER_SLICE_S):
            if ref() is None:
                break
            if _target_closed(target):
                close_target = True
                break
            now = time.monotonic()
            if interval is not None and now >= next_ping:
                sock.send_multipart([codec.encode(next(_UIDS)), ping_op, payload])
                next_ping = now + interval
                if now - last_pong > 2.5 * interval and not warned:
                    warned = True
                    logger.warning("KV event subscription %d: pings to %s go unanswered",
                                   instance_id, url)
            while sock.poll(0):
                sock.recv_multipart()
                last_pong, warned = now, False
    except zmq.ZMQError as err:
        logger.debug("KV event ping thread stopped: %s", err)
    finally:
        sock.close(linger=0)
    sub = ref() if close_target else None
    if sub is not None:
        logger.info("KV event subscription %d: the context was closed; closing", instance_id)
        if sub.end_reason is None:
            sub.end_reason = "the SDK context was closed"
        sub.close()
