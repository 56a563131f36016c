"""KV events of the LMCache MP server, SDK store announcements, and a vLLM-format publisher.

Three layers (protocol doc §2.6, §9):

* :func:`subscribe` opens the server's credit-based ``subscribe_kv_events`` stream on a
  DEALER socket of its own and returns a :class:`KVEventSubscription`, an iterator of
  typed :class:`KVEventBatch` objects. Each batch is acknowledged when the consumer asks
  for the next one (the server sends the next batch only after that ack); a ``ping``
  thread keeps the subscription alive against the server's reaper; a lost connection is
  resumed at the cursor; a server restart is surfaced as
  ``batch.incarnation_changed`` (and the stream restarts from cursor 0 of the new server).
* SDK stores announce themselves: :func:`announce_store` turns a store of this SDK into
  ``stored`` :class:`KVEventRecord` objects whose block hashes are computed exactly like
  the server's (blake3 chain, :mod:`lmcache_kv_fast.hashing`) and hands them to in-process
  listeners (:func:`add_listener`, keyed by model name). The server itself records no
  ``stored`` event for engine-driven (SDK) stores (doc §11 #21).
* :class:`KVEventPublisher` republishes both sources in vLLM's KV-events wire format (ZMQ
  PUB multipart ``(topic, seq:8 bytes big-endian, msgpack KVEventBatch)`` plus vLLM's
  optional ROUTER replay socket), mapping records the way LMCache's vLLM adapter does:
  ``stored`` ⇒ ``BlockStored`` for hashes not announced yet, ``removed`` ⇒ ``BlockRemoved``
  of the announced subset, ``lost`` / a new server incarnation / an ended stream ⇒ one
  ``BlockRemoved`` of everything announced (withdraw), then continue.

:func:`events_main` is the ``lmcache-kv-fast events`` command. Nothing here imports
``lmcache``; ``blake3`` is needed only for announcements (optional dependency).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import re
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache_kv_fast.errors import (
    ContextClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
    ProtocolError,
    ServerTimeoutError,
)
from lmcache_kv_fast.hashing import (
    HASH_ALGORITHM,
    blake3_available,
    chunk_hashes,
    require_blake3,
)
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol import types as _wire
from lmcache_kv_fast.protocol.constants import (
    DEFAULT_REAP_TIMEOUT_S,
    FORBIDDEN_MODEL_CHARS,
    INSTANCE_ID_BITS,
    MAX_EVENTS_PER_BATCH,
    STREAM_ACK,
    STREAM_CANCEL,
)
from lmcache_kv_fast.protocol.detect import detect_generation
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.protocol.types import KVEventRecord
from lmcache_kv_fast.transport.http import HttpInfoClient

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PUBLISH",
    "DEFAULT_TOPIC",
    "KV_EVENT_CAPABILITY",
    "LOCAL_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventsEndpoint",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventRecord",
    "KVEventSubscription",
    "KVEventTimeout",
    "StoreAnnouncement",
    "VllmEventMapper",
    "VllmKVEventBatch",
    "VllmZmqPublisher",
    "add_listener",
    "announce_store",
    "chunk_hashes",
    "decode_vllm_batch",
    "encode_vllm_batch",
    "events_main",
    "has_listeners",
    "remove_listener",
    "subscribe",
]

#: Capability string of ``get_experimental`` when the server records KV events (doc §3.12).
KV_EVENT_CAPABILITY = "kv_event_stream"
#: ``seq`` of records produced by this SDK (server records start at 1).
LOCAL_SEQ = 0
#: Kinds of server records (doc §4.5).
KIND_STORED = "stored"
KIND_REMOVED = "removed"
#: The only medium the MP server reports.
MEDIUM_CPU = "CPU"

#: vLLM publisher defaults (``--kv-events-config``: endpoint / replay_endpoint / topic).
DEFAULT_PUBLISH = "tcp://127.0.0.1:5557"
DEFAULT_TOPIC = "kv-events"
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000

#: The consumer wakes this often while waiting, to notice close() and a closed context.
_POLL_SLICE_S = 0.1
#: The ping thread wakes this often (it also watches the context).
_PINGER_SLICE_S = 0.1
#: get_experimental and the first batch must arrive within this (capped by ctx.timeout).
_PROBE_TIMEOUT_S = 5.0
#: close() waits this long for the server's end marker after ``cancel``.
DEFAULT_CLOSE_TIMEOUT_S = 1.0
#: ZMTP heartbeats on the stream socket detect a silently dead server (ms).
_HEARTBEAT_IVL_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 6000

_UIDS = itertools.count(int.from_bytes(os.urandom(3), "big") << 8)
_ZMQ_URL = re.compile(r"^tcp://[^\s/:]+:\d{1,5}$")
_HTTP_URL = re.compile(r"^https?://[^\s/]+(:\d{1,5})?/?$")


# ---------------------------------------------------------------------------- batch types
class KVEventBatch(_wire.KVEventBatch, kw_only=True):
    """One batch of the server's KV event stream (doc §4.5), as the subscription yields it.

    Wire fields: ``enabled``, ``incarnation`` (server start time in ns), ``next_cursor``,
    ``lost``, ``events`` (:class:`KVEventRecord`, filtered to the subscribed model).

    Attributes:
        incarnation_changed: Set by the client: this batch comes from a different server
            incarnation than the previous batch of the same subscription (the server was
            restarted and lost its cache). Everything learned before is void.
    """

    incarnation_changed: bool = False

    @property
    def resync(self) -> bool:
        """True when everything announced before must be withdrawn (lost or restarted)."""
        return self.lost or self.incarnation_changed


class KVEventTimeout(ServerTimeoutError):
    """No batch arrived within the subscription's ``timeout``; the subscription stays open."""


# ---------------------------------------------------------------------------- endpoint
@dataclass(frozen=True)
class EventsEndpoint:
    """What a subscription needs of a server, without a registered KV layout.

    :class:`~lmcache_kv_fast.context.LMCacheKVCacheContext` provides the same attributes;
    use this for a process that only watches events (``lmcache-kv-fast events``).

    Attributes:
        url: ZMQ URL ``tcp://host:port``.
        http_url: HTTP URL ``http://host:port``.
        model_name: Model whose events are wanted.
        generation: Wire dialect of the server.
        chunk_size: Tokens per chunk (vLLM ``block_size`` of published events).
        timeout: Seconds for probes.
        reap_timeout_s: ``--worker-reap-timeout-seconds`` of the server (0 = no reaping).
        hash_algorithm: ``--hash-algorithm`` of the server.
        server_version: ``/version`` or the detected generation.
    """

    url: str
    http_url: str
    model_name: str
    generation: Generation
    chunk_size: int
    timeout: float = 10.0
    reap_timeout_s: float = DEFAULT_REAP_TIMEOUT_S
    hash_algorithm: str = HASH_ALGORITHM
    server_version: str = ""

    @property
    def closed(self) -> bool:
        """Always False (an endpoint has nothing to close)."""
        return False

    @classmethod
    def probe(cls, url: str, http_url: str, model_name: str,
              timeout: float = 10.0) -> EventsEndpoint:
        """Read ``/config`` and ``/version`` of a server (no ZMQ call, no registration).

        Raises:
            InvalidArgumentError: A malformed URL or model name.
            KVCacheSDKError: The HTTP plane does not answer or the server is unusable.
        """
        _check_endpoint_args(url, http_url, model_name, timeout)
        http = HttpInfoClient(http_url.rstrip("/"), min(timeout, _PROBE_TIMEOUT_S))
        mp = http.config()["mp"]
        chunk = mp.get("chunk_size")
        if type(chunk) is not int or chunk <= 0:
            raise ProtocolError(f"/config mp.chunk_size: expected a positive int, got {chunk!r}")
        if mp.get("transport", "zmq") != "zmq":
            raise KVCacheSDKError(
                f"the server at {http_url} uses transport {mp.get('transport')!r}; this SDK "
                "speaks the ZMQ transport"
            )
        version = http.version()
        gen, _ = detect_generation(version, mp)
        return cls(
            url=url, http_url=http_url.rstrip("/"), model_name=model_name, generation=gen,
            chunk_size=chunk, timeout=float(timeout),
            reap_timeout_s=_reap_from_mp(mp),
            hash_algorithm=str(mp.get("hash_algorithm", HASH_ALGORITHM)),
            server_version=(version or f"{gen.name} (detected)").strip('"'),
        )


def _check_endpoint_args(url: Any, http_url: Any, model_name: Any, timeout: Any) -> None:
    if not isinstance(url, str) or not _ZMQ_URL.match(url):
        raise InvalidArgumentError(f"url must look like 'tcp://host:port', got {url!r:.80}")
    if not isinstance(http_url, str) or not _HTTP_URL.match(http_url):
        raise InvalidArgumentError(
            f"http_url must look like 'http://host:port', got {http_url!r:.80}"
        )
    if not isinstance(model_name, str) or not model_name:
        raise InvalidArgumentError(f"model_name must be a non-empty str, got {model_name!r:.80}")
    if FORBIDDEN_MODEL_CHARS.intersection(model_name):
        raise InvalidArgumentError(f"model_name must not contain '@', got {model_name!r:.80}")
    _check_seconds(timeout, "timeout")


def _check_seconds(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidArgumentError(f"{what} must be a positive number of seconds, got {v!r}")
    return float(v)


def _reap_from_mp(mp: dict[str, Any]) -> float:
    v = mp.get("worker_reap_timeout_seconds", DEFAULT_REAP_TIMEOUT_S)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return DEFAULT_REAP_TIMEOUT_S
    return float(v)


def _ping_interval(reap_timeout_s: float) -> float | None:
    """Ping often enough that the reaper never closes a live subscription (doc §3.11)."""
    if reap_timeout_s <= 0:
        return None
    return max(1.0, min(reap_timeout_s / 4.0, 30.0))


def _target_closed(target: Any) -> bool:
    try:
        return bool(getattr(target, "closed", False))
    except Exception:  # a half-torn-down context counts as closed
        return True


def _target_reap_timeout(target: Any) -> float:
    reap = getattr(target, "reap_timeout_s", None)
    if isinstance(reap, (int, float)) and not isinstance(reap, bool):
        return float(reap)
    try:
        mp = HttpInfoClient(target.http_url, _PROBE_TIMEOUT_S).config()["mp"]
    except (KVCacheSDKError, AttributeError, KeyError, TypeError):
        return DEFAULT_REAP_TIMEOUT_S
    return _reap_from_mp(mp)


# ---------------------------------------------------------------------------- subscription
def send_stream_control(sock: zmq.Socket, uid_frame: bytes, action: bytes) -> None:
    """Send a stream control frame ``[uid, b"", action]`` (``ack`` / ``cancel``, doc §2.2).

    Args:
        sock: The DEALER the subscribe request went out on.
        uid_frame: The subscribe request's uid frame, byte for byte.
        action: ``b"ack"`` or ``b"cancel"``.
    """
    if action not in (STREAM_ACK, STREAM_CANCEL):
        raise InvalidArgumentError(f"stream control must be ack or cancel, got {action!r}")
    sock.send_multipart([uid_frame, b"", action])


def subscribe(ctx: Any, *, cursor: int = 0, max_events: int = MAX_EVENTS_PER_BATCH,
              timeout: float | None = None, instance_id: int | None = None) -> KVEventSubscription:
    """Subscribe to the server's KV events of ``ctx.model_name``.

    Args:
        ctx: An :class:`~lmcache_kv_fast.context.LMCacheKVCacheContext` or an
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
        An open :class:`KVEventSubscription` whose first batch (the server's status batch,
        possibly without events) has already arrived.

    Raises:
        InvalidArgumentError: Bad ``cursor``/``max_events``/``timeout``/``instance_id``
            (nothing is sent).
        KVCacheSDKError: The server has no KV-event stream (older than 0.5.6, or events
            disabled), or it did not answer.
        ContextClosedError: ``ctx`` is closed.
    """
    return KVEventSubscription(ctx, cursor=cursor, max_events=max_events, timeout=timeout,
                               instance_id=instance_id)


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


class KVEventSubscription:
    """An open ``subscribe_kv_events`` stream (doc §2.6, §9); iterate to get batches.

    Create it with :func:`subscribe`. Iteration yields :class:`KVEventBatch` objects and
    acknowledges each one when the next is requested (credit-based: the server sends the
    next batch only after the ack). Use one consumer thread at a time; :meth:`close` may be
    called from any thread.

    Closing (:meth:`close`, leaving a ``with`` block, garbage collection, or closing the
    context it was created from) sends ``cancel`` and waits briefly for the server's end
    marker. Iteration then stops.

    Resilience:

    * A ``ping(instance_id)`` thread keeps the subscription alive against the server's
      reaper (doc §3.11).
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
        gen: Generation | None = getattr(target, "generation", None)
        if not isinstance(gen, Generation) or not gen.supports(Op.SUBSCRIBE_KV_EVENTS) \
                or not gen.supports(Op.GET_EXPERIMENTAL):
            name = gen.name if isinstance(gen, Generation) else "unknown"
            raise KVCacheSDKError(
                f"the LMCache server at {getattr(target, 'url', '?')} (generation {name}) has "
                "no KV-event stream: subscribe_kv_events exists from LMCache 0.5.6 on"
            )
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
            self._sock.connect(self.url)
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

    # ------------------------------------------------------------------ properties
    @property
    def cursor(self) -> int:
        """Resume point: ``next_cursor`` of the last batch returned (or the start cursor)."""
        return self._cursor

    @property
    def incarnation(self) -> int | None:
        """Server incarnation of the last batch returned."""
        return self._incarnation

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the subscription shut itself down)."""
        return self._closed

    @property
    def active(self) -> bool:
        """True while batches can still come (not closed, not ended by the server)."""
        return not self._closed and not self._ended and self._error is None

    @property
    def timeout(self) -> float | None:
        """Seconds ``next()`` waits for a batch (None = forever)."""
        return self._timeout

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[KVEventBatch]:
        return self

    def __next__(self) -> KVEventBatch:
        batch = self._next(self._timeout)
        if batch is not None:
            return batch
        if self.active:
            raise KVEventTimeout(
                f"no KV event batch for {self.model_name!r} from {self.url} within "
                f"{self._timeout:g}s (the subscription stays open)"
            )
        raise StopIteration

    def poll(self, timeout: float | None = 0.0) -> KVEventBatch | None:
        """Return the next batch, or None after ``timeout`` seconds or once inactive.

        Args:
            timeout: Seconds to wait; None waits until a batch arrives or the stream ends.

        Raises:
            ProtocolError: The server sent a malformed batch (the subscription is closed).
        """
        if timeout is not None and (isinstance(timeout, bool) or
                                    not isinstance(timeout, (int, float)) or timeout < 0):
            raise InvalidArgumentError(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        return self._next(timeout)

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

    # ------------------------------------------------------------------ socket work
    def _check_capability(self, probe: float) -> None:
        uid = codec.encode(next(_UIDS))
        self._call_uid, self._call_reply = uid, None
        self._sock.send_multipart([uid, codec.encode(self._gen.op_frame_value(Op.GET_EXPERIMENTAL))])
        deadline = time.monotonic() + probe
        while self._call_reply is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVCacheSDKError(
                    f"get_experimental on {self.url} got no reply within {probe:g}s: the "
                    "server is not reachable there or is older than LMCache 0.5.6"
                )
            self._pump(min(left, _POLL_SLICE_S))
        frames, self._call_uid, self._call_reply = self._call_reply, None, None
        caps = codec.decode(frames[2], list[str], what="get_experimental") \
            if len(frames) == 3 else []
        if KV_EVENT_CAPABILITY not in caps:
            raise KVCacheSDKError(
                f"the LMCache server at {self.url} does not record KV events (get_experimental "
                f"= {caps!r}); start it without --kv-event-log-size 0 and without "
                "--disable-observability"
            )

    def _send_subscribe(self, cursor: int, *, resync: bool = False) -> None:
        uid = codec.encode(next(_UIDS))
        self._sock.send_multipart([
            uid, self._op_frame, codec.encode(self.instance_id), codec.encode(self.model_name),
            codec.encode(cursor), codec.encode(self.max_events),
        ])
        self._stream_uid = uid
        self._sent_cursor = cursor
        self._check_resync = resync

    def _pump(self, wait_s: float) -> None:
        ready = dict(self._poller.poll(max(0, int(wait_s * 1000))))
        if self._monitor in ready:
            while True:
                try:
                    msg = recv_monitor_message(self._monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_monitor(int(msg["event"]))
        if self._sock in ready:
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_frames(frames)

    def _on_monitor(self, event: int) -> None:
        if self._closed or self._cancelling or self._ended:
            return
        if event == zmq.EVENT_DISCONNECTED:
            if not self._need_resubscribe:
                logger.warning("KV event stream: lost the connection to %s; resubscribing at "
                               "cursor %d when it is back", self.url, self._recv_cursor)
            self._stream_uid = None
            self._unacked_uid = None
            self._need_resubscribe = True
        elif event == zmq.EVENT_CONNECTED and self._need_resubscribe:
            self._need_resubscribe = False
            logger.info("KV event stream: reconnected to %s; resubscribing", self.url)
            self._send_subscribe(self._recv_cursor, resync=True)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        uid = frames[0]
        if uid == self._call_uid:
            self._call_reply = frames
            return
        if uid != self._stream_uid:
            logger.debug("KV event stream: dropping a frame of an old stream")
            return
        if frames[1] != self._op_frame:
            logger.warning("KV event stream: reply echoed operation %r, ignoring it",
                           frames[1][:40])
            return
        if len(frames) == 2:  # end marker
            self._stream_uid = None
            if self._cancelling:
                self._cancel_done = True
            else:
                self._ended = True
                self.end_reason = (
                    "the server ended the stream (a newer subscription with the same "
                    "instance_id, the reaper, or KV events disabled)"
                )
                logger.info("KV event stream of %r on %s ended by the server",
                            self.model_name, self.url)
            return
        if self._cancelling:
            return
        if len(frames) != 3:
            self._error = ProtocolError(
                f"subscribe_kv_events batch from {self.url} has {len(frames)} frames, expected 3"
            )
            self.end_reason = str(self._error)
            return
        try:
            batch = codec.decode(frames[2], KVEventBatch, what="subscribe_kv_events")
        except ProtocolError as err:
            self._error = err
            self.end_reason = str(err)
            return
        self._on_batch(uid, batch)

    def _on_batch(self, uid: bytes, batch: KVEventBatch) -> None:
        prev = self._last_incarnation
        changed = prev is not None and batch.incarnation != prev
        if self._check_resync:
            self._check_resync = False
            if changed and self._sent_cursor != 0:
                logger.warning(
                    "KV event stream: the server at %s restarted (incarnation %d -> %d); "
                    "restarting the stream at cursor 0", self.url, prev, batch.incarnation)
                self._send_subscribe(0)  # replaces this stream; its end marker is dropped
                return
            if not changed and not batch.events and not batch.lost and batch.enabled:
                # Reconnected to the same server and nothing is new: no batch to surface,
                # but the credit must be returned for the stream to go on.
                self._recv_cursor = batch.next_cursor
                send_stream_control(self._sock, uid, STREAM_ACK)
                return
        batch.incarnation_changed = changed
        self._last_incarnation = batch.incarnation
        self._recv_cursor = batch.next_cursor
        self._pending = (uid, batch)
        if not batch.enabled:
            logger.warning("the LMCache server at %s reports KV events disabled", self.url)

    # ------------------------------------------------------------------ liveness
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

    def __enter__(self) -> KVEventSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close(timeout=0.2)

    def __repr__(self) -> str:
        state = "active" if self.active else "closed" if self._closed else "ended"
        return (f"KVEventSubscription(model={self.model_name!r}, url={self.url!r}, "
                f"instance_id={self.instance_id}, cursor={self._cursor}, {state})")


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
        sock.connect(url)
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


# ---------------------------------------------------------------------------- announcements
@dataclass(frozen=True)
class StoreAnnouncement:
    """One SDK store, as its listeners see it.

    Attributes:
        model_name: Model the chunks were stored under.
        url: ZMQ URL of the server that holds them.
        cache_salt: The store's salt (not part of the hashes; a separate key field).
        chunk_size: Tokens per chunk.
        records: One ``stored`` record per chunk (``seq`` = :data:`LOCAL_SEQ`).
    """

    model_name: str
    url: str
    cache_salt: str
    chunk_size: int
    records: tuple[KVEventRecord, ...]


Listener = Callable[[StoreAnnouncement], None]

_listeners_lock = threading.Lock()
_listeners: dict[str, tuple[Listener, ...]] = {}
_hash_algorithms: dict[str, str] = {}
_warned_no_blake3 = False


def _model_of(target: Any) -> str:
    model = target if isinstance(target, str) else getattr(target, "model_name", None)
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError(
            f"expected a context, an endpoint or a model name, got {type(target).__name__}"
        )
    return model


def server_hash_algorithm(target: Any) -> str:
    """Return the server's ``--hash-algorithm`` (``/config`` ``mp.hash_algorithm``), cached.

    Raises:
        KVCacheSDKError: ``/config`` cannot be read.
    """
    ha = getattr(target, "hash_algorithm", None)
    if isinstance(ha, str):
        return ha
    http_url = target.http_url
    with _listeners_lock:
        cached = _hash_algorithms.get(http_url)
    if cached is not None:
        return cached
    mp = HttpInfoClient(http_url, _PROBE_TIMEOUT_S).config()["mp"]
    ha = str(mp.get("hash_algorithm", HASH_ALGORITHM))
    with _listeners_lock:
        _hash_algorithms[http_url] = ha
    return ha


def add_listener(target: Any, fn: Listener, *, check_hash_algorithm: bool = True
                 ) -> Callable[[], None]:
    """Call ``fn(announcement)`` after every store of this SDK for the target's model.

    Listeners run synchronously on the storing thread, right after the store; they must be
    quick and must not raise (exceptions are logged and swallowed).

    Args:
        target: A context or endpoint (its ``model_name``), or a model name.
        fn: Called with a :class:`StoreAnnouncement`.
        check_hash_algorithm: With a context/endpoint, verify that the server hashes with
            blake3 (else the announced hashes would not be the server's).

    Returns:
        A function that removes the listener.

    Raises:
        KVCacheSDKError: ``blake3`` is not installed, or the server uses another hash
            algorithm.
    """
    if not callable(fn):
        raise InvalidTypeError(f"fn must be callable, got {type(fn).__name__}")
    model = _model_of(target)
    require_blake3()
    if check_hash_algorithm and not isinstance(target, str):
        ha = server_hash_algorithm(target)
        if ha != HASH_ALGORITHM:
            raise KVCacheSDKError(
                f"the server at {getattr(target, 'http_url', '?')} hashes chunks with {ha!r}; "
                f"SDK store announcements reproduce only {HASH_ALGORITHM!r}"
            )
    with _listeners_lock:
        _listeners[model] = (*_listeners.get(model, ()), fn)
    return lambda: remove_listener(model, fn)


def remove_listener(target: Any, fn: Listener) -> bool:
    """Remove a listener added with :func:`add_listener`; True if it was registered."""
    model = _model_of(target)
    with _listeners_lock:
        fns = _listeners.get(model, ())
        if fn not in fns:
            return False
        rest = tuple(f for f in fns if f is not fn)
        if rest:
            _listeners[model] = rest
        else:
            _listeners.pop(model, None)
    return True


def has_listeners(model_name: str) -> bool:
    """Whether any listener wants announcements for ``model_name`` (cheap; no hashing)."""
    return model_name in _listeners


def announce_store(ctx: Any, tokens: Sequence[int] | Any, cache_salt: str = "",
                   chunks_stored: int | None = None) -> list[KVEventRecord]:
    """Announce a store of this SDK to the listeners of ``ctx.model_name``.

    The context calls this after a successful store. Without listeners it returns at once
    (nothing is hashed); it never raises.

    Args:
        ctx: The storing context (``model_name``, ``chunk_size``, ``url``).
        tokens: The stored token ids from position 0.
        cache_salt: The store's salt.
        chunks_stored: Leading whole chunks now in the cache (None: all whole chunks).

    Returns:
        The ``stored`` records delivered (one per chunk, parent chain, chunk token ids),
        or ``[]`` when nobody listens or nothing whole was stored.
    """
    global _warned_no_blake3
    try:
        model = ctx.model_name
        with _listeners_lock:
            fns = _listeners.get(model, ())
        if not fns:
            return []
        if not blake3_available():
            if not _warned_no_blake3:
                _warned_no_blake3 = True
                logger.warning("store announcements skipped: pip install blake3")
            return []
        c = int(ctx.chunk_size)
        toks = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        hashes = chunk_hashes(toks, c, max_chunks=chunks_stored)
        records = tuple(
            KVEventRecord(
                seq=LOCAL_SEQ, kind=KIND_STORED, medium=MEDIUM_CPU, model_name=model,
                block_hashes=[h], parent_block_hash=hashes[i - 1] if i else None,
                token_ids=list(toks[i * c:(i + 1) * c]),
            )
            for i, h in enumerate(hashes)
        )
    except Exception:  # announcing must never break a store
        logger.exception("could not compute the store announcement")
        return []
    if not records:
        return []
    ann = StoreAnnouncement(model, str(getattr(ctx, "url", "")), cache_salt, c, records)
    for fn in fns:
        try:
            fn(ann)
        except Exception:  # a broken listener must not break a store
            logger.exception("KV event listener %r failed", fn)
    return list(records)


# ---------------------------------------------------------------------------- vLLM wire types
ExternalBlockHash = bytes | int
WireFormat = Literal["array", "map"]


class _VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's tagged KV cache events (``vllm/distributed/kv_events.py``)."""


class BlockStored(_VllmEvent, tag="BlockStored"):
    """vLLM ``BlockStored``: blocks became available in ``medium``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_VllmEvent, tag="BlockRemoved"):
    """vLLM ``BlockRemoved``: blocks left ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    """vLLM ``AllBlocksCleared``."""


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


_VLLM_ENCODER = msgspec.msgpack.Encoder()
_VLLM_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def _event_as_map(ev: VllmEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(ev).__struct_config__.tag}
    for name in ev.__struct_fields__:
        out[name] = getattr(ev, name)
    return out


def encode_vllm_batch(batch: VllmKVEventBatch, wire_format: WireFormat = "array") -> bytes:
    """Encode a batch as vLLM's publisher does.

    Args:
        batch: The batch.
        wire_format: ``"array"`` - every struct positional (``array_like``), as vLLM up to
            0.23 and its ``kv_events_subscriber.py`` example; ``"map"`` - the batch
            positional, each event a map with a ``"type"`` tag, as vLLM after PR #42892.

    Returns:
        The msgpack payload frame.
    """
    if wire_format == "array":
        return _VLLM_ENCODER.encode(batch)
    if wire_format == "map":
        return _VLLM_ENCODER.encode(
            [batch.ts, [_event_as_map(e) for e in batch.events], batch.data_parallel_rank])
    raise InvalidArgumentError(f"wire_format must be 'array' or 'map', got {wire_format!r}")


def decode_vllm_batch(payload: bytes) -> VllmKVEventBatch:
    """Decode a positional (``"array"``) vLLM batch payload (for tests and tools)."""
    return _VLLM_DECODER.decode(payload)


def _int_hash(h: bytes) -> int:
    """Return the hash as vLLM's ``maybe_convert_block_hash`` does with int hashes on."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class VllmEventMapper:
    """Turn MP-server records into vLLM events like LMCache's vLLM adapter (doc §9).

    Keeps the set of announced hashes: ``stored`` ⇒ one ``BlockStored`` per record for its
    hashes not announced yet (records without token ids are skipped); ``removed`` ⇒ one
    ``BlockRemoved`` of the announced subset; ``lost``, a changed incarnation or
    :meth:`withdraw_all` ⇒ one ``BlockRemoved`` of everything announced (sorted). Records
    of another medium are ignored.

    Args:
        block_size: ``block_size`` of ``BlockStored`` (the server's chunk size).
        int_block_hashes: Publish hashes as ints (low 64 bits), like vLLM with
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``; default raw 32-byte hashes.
    """

    def __init__(self, block_size: int, *, int_block_hashes: bool = False) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.int_block_hashes = int_block_hashes
        self.announced: set[bytes] = set()
        self.incarnation: int | None = None

    def _ext(self, h: bytes) -> ExternalBlockHash:
        return _int_hash(h) if self.int_block_hashes else h

    def on_batch(self, batch: _wire.KVEventBatch) -> list[VllmEvent]:
        """Map one server batch (withdraw first when it says so)."""
        out: list[VllmEvent] = []
        changed = getattr(batch, "incarnation_changed", False) or (
            self.incarnation is not None and batch.incarnation != self.incarnation)
        if changed or batch.lost:
            reason = "server restart" if changed else "events lost"
            out.extend(self.withdraw_all(reason))
        self.incarnation = batch.incarnation
        out.extend(self.on_records(batch.events))
        return out

    def on_records(self, records: Sequence[KVEventRecord]) -> list[VllmEvent]:
        """Map records (server or SDK announcements) in order."""
        out: list[VllmEvent] = []
        for r in records:
            if r.medium != MEDIUM_CPU:
                continue
            if r.kind == KIND_STORED:
                new = [h for h in r.block_hashes if h not in self.announced]
                if not new or not r.token_ids:
                    continue
                self.announced.update(new)
                parent = r.parent_block_hash
                out.append(BlockStored(
                    block_hashes=[self._ext(h) for h in new],
                    parent_block_hash=None if parent is None else self._ext(parent),
                    token_ids=list(r.token_ids), block_size=self.block_size, lora_id=None,
                    medium=MEDIUM_CPU, lora_name=None,
                ))
            elif r.kind == KIND_REMOVED:
                gone = [h for h in r.block_hashes if h in self.announced]
                if not gone:
                    continue
                self.announced.difference_update(gone)
                out.append(BlockRemoved(block_hashes=[self._ext(h) for h in gone],
                                        medium=MEDIUM_CPU))
            else:
                logger.warning("ignoring KV event record of unknown kind %r", r.kind)
        return out

    def withdraw_all(self, reason: str = "resync") -> list[VllmEvent]:
        """Forget everything announced; return the ``BlockRemoved`` that says so (or [])."""
        if not self.announced:
            return []
        logger.warning("withdrawing %d announced KV blocks (%s)", len(self.announced), reason)
        hashes = sorted(self.announced)
        self.announced.clear()
        return [BlockRemoved(block_hashes=[self._ext(h) for h in hashes], medium=MEDIUM_CPU)]


# ---------------------------------------------------------------------------- ZMQ publisher
class VllmZmqPublisher:
    """vLLM's ``ZmqEventPublisher`` wire behaviour: PUB + optional ROUTER replay.

    Every batch goes out as ``(topic, seq, payload)`` with ``seq`` an 8-byte big-endian
    counter from 0; the last ``buffer_steps`` payloads are kept for replay. A replay client
    (REQ, or DEALER with an empty delimiter) sends the 8-byte big-endian start seq and gets
    ``(seq, payload)`` for every buffered batch with ``seq >= start``, then the end marker
    ``(-1 as 8 signed big-endian bytes, b"")``.

    :meth:`publish` is thread-safe; :meth:`service_replay` must be called from one thread.

    Args:
        endpoint: PUB endpoint.
        replay_endpoint: ROUTER endpoint for replay requests (None: no replay).
        topic: Topic frame.
        buffer_steps: Batches kept for replay.
        hwm: PUB high-water mark.
        wire_format: See :func:`encode_vllm_batch`.
        bind: Bind the PUB endpoint (default). False connects it (e.g. to an XSUB proxy).
            vLLM binds only wildcard endpoints; a publisher of this SDK is the event
            source, so it binds ``tcp://127.0.0.1:5557`` too.

    Raises:
        KVCacheSDKError: An endpoint cannot be bound (in use, malformed).
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str = DEFAULT_PUBLISH, *, replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = DEFAULT_BUFFER_STEPS,
                 hwm: int = DEFAULT_HWM, wire_format: WireFormat = "array",
                 bind: bool = True) -> None:
        if wire_format not in ("array", "map"):
            raise InvalidArgumentError(f"wire_format must be 'array' or 'map', got {wire_format!r}")
        if type(buffer_steps) is not int or buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be a positive int, got {buffer_steps!r}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.wire_format: WireFormat = wire_format
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._zctx = zmq.Context(io_threads=1)
        self._pub: zmq.Socket = self._zctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(hwm)
            _attach(self._pub, endpoint, bind, "publish")
            if replay_endpoint is not None:
                self._replay = self._zctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                _attach(self._replay, replay_endpoint, True, "replay")
        except BaseException:
            self.close()
            raise

    @property
    def replay_socket(self) -> zmq.Socket | None:
        """The ROUTER replay socket (for polling), or None."""
        return self._replay

    def publish(self, batch: VllmKVEventBatch) -> int:
        """Send one batch; return its seq.

        Raises:
            ContextClosedError: The publisher is closed.
        """
        payload = encode_vllm_batch(batch, self.wire_format)
        with self._lock:
            if self._closed:
                raise ContextClosedError("the KV event publisher is closed")
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        return seq

    def service_replay(self, timeout: float = 0.0) -> int:
        """Answer the replay requests that arrive within ``timeout`` seconds; return how many."""
        sock = self._replay
        if sock is None or self._closed:
            if timeout > 0:
                time.sleep(timeout)
            return 0
        served = 0
        if not sock.poll(max(0, int(timeout * 1000))):
            return 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return served
            if len(frames) != 3:
                logger.warning("invalid replay request with %d frames", len(frames))
                continue
            client_id, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                buffered = [(s, b) for s, b in self._buffer if s >= start]
            for seq, payload in buffered:
                sock.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client_id, b"", self.END_SEQ, b""))
            served += 1

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
        self._zctx.term()


def _attach(sock: zmq.Socket, endpoint: str, bind: bool, what: str) -> None:
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as err:
        raise KVCacheSDKError(
            f"cannot {'bind' if bind else 'connect'} the {what} endpoint {endpoint!r}: {err}"
        ) from err


# ---------------------------------------------------------------------------- publisher
PublishHook = Callable[[int, VllmKVEventBatch], None]


class KVEventPublisher:
    """Republish a model's KV events in vLLM's wire format (doc §9).

    Sources: the server's event stream of the model (a :class:`KVEventSubscription`) and,
    when the publisher runs in the process that stores, this SDK's own store announcements
    (the server records no ``stored`` event for them). Both go through one
    :class:`VllmEventMapper`, so a chunk is announced once whichever source saw it first.
    When the stream is lost or ended, or the server restarts, everything announced is
    withdrawn and the stream restarts at cursor 0 (like LMCache's vLLM adapter).

    Run it with :meth:`run` (blocking; returns after :meth:`stop`) or :meth:`start` (a
    background thread); :meth:`stop` closes everything. A context manager starts/stops it.

    Args:
        source: An :class:`~lmcache_kv_fast.context.LMCacheKVCacheContext`, an
            :class:`EventsEndpoint`, or a ZMQ URL (then ``http_url`` and ``model_name``
            are required).
        http_url: HTTP URL of the server when ``source`` is a URL.
        model_name: Model when ``source`` is a URL.
        publish: PUB endpoint (bound, see :class:`VllmZmqPublisher`).
        topic: Topic frame of every message.
        replay: ROUTER replay endpoint (None: no replay).
        cursor: Server cursor to start from (0: replay the retained log).
        max_events: Records per server batch.
        timeout: Probe timeout in seconds when ``source`` is a URL.
        wire_format: ``"array"`` (vLLM <= 0.23, default) or ``"map"``.
        int_block_hashes: Publish hashes as 64-bit ints like vLLM's
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
        data_parallel_rank: ``data_parallel_rank`` of every batch (vLLM sets its rank).
        buffer_steps: Replay buffer size.
        hwm: PUB high-water mark.
        announce_local: Also publish this process's SDK stores of the model.
        on_publish: Called as ``on_publish(seq, batch)`` after each published batch.

    Raises:
        KVCacheSDKError: The server has no event stream, an endpoint cannot be bound, ...
    """

    def __init__(self, source: Any, *, http_url: str | None = None,
                 model_name: str | None = None, publish: str = DEFAULT_PUBLISH,
                 topic: str = DEFAULT_TOPIC, replay: str | None = None, cursor: int = 0,
                 max_events: int = MAX_EVENTS_PER_BATCH, timeout: float = 10.0,
                 wire_format: WireFormat = "array", int_block_hashes: bool = False,
                 data_parallel_rank: int | None = 0, buffer_steps: int = DEFAULT_BUFFER_STEPS,
                 hwm: int = DEFAULT_HWM, announce_local: bool = True,
                 on_publish: PublishHook | None = None) -> None:
        self._closed = True
        if isinstance(source, str):
            if http_url is None or model_name is None:
                raise InvalidArgumentError(
                    "with a ZMQ URL as source, http_url and model_name are required")
            source = EventsEndpoint.probe(source, http_url, model_name, timeout)
        self._target = source
        self.model_name: str = source.model_name
        self.url: str = source.url
        self._max_events = max_events
        self._dp_rank = data_parallel_rank
        self._on_publish = on_publish
        self._lock = threading.RLock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._run_thread: threading.Thread | None = None
        self._done = threading.Event()
        self._remove_listener: Callable[[], None] | None = None
        self.mapper = VllmEventMapper(int(source.chunk_size), int_block_hashes=int_block_hashes)
        self._sub: KVEventSubscription | None = None
        self._zpub = VllmZmqPublisher(publish, replay_endpoint=replay, topic=topic,
                                      buffer_steps=buffer_steps, hwm=hwm,
                                      wire_format=wire_format)
        self._closed = False
        try:
            self._sub = subscribe(source, cursor=cursor, max_events=max_events)
            if announce_local:
                self._enable_local()
        except BaseException:
            self._cleanup()
            raise
        logger.info("publishing KV events of %r from %s on %s topic %r%s", self.model_name,
                    self.url, publish, topic, f" (replay {replay})" if replay else "")

    def _enable_local(self) -> None:
        if not blake3_available():
            logger.warning("not publishing this process's SDK stores: pip install blake3")
            return
        try:
            ha = server_hash_algorithm(self._target)
        except KVCacheSDKError as err:
            logger.warning("not publishing SDK stores: cannot read the hash algorithm: %s", err)
            return
        if ha != HASH_ALGORITHM:
            logger.warning("not publishing SDK stores: the server hashes with %r, not %r",
                           ha, HASH_ALGORITHM)
            return
        self._remove_listener = add_listener(self.model_name, self._on_local,
                                             check_hash_algorithm=False)

    # ------------------------------------------------------------------ properties
    @property
    def subscription(self) -> KVEventSubscription | None:
        """The current server subscription."""
        return self._sub

    @property
    def closed(self) -> bool:
        """Whether the publisher was stopped."""
        return self._closed

    # ------------------------------------------------------------------ publishing
    def _emit(self, events: list[VllmEvent]) -> None:
        """Publish one batch (caller holds the lock)."""
        if not events or self._closed:
            return
        batch = VllmKVEventBatch(ts=time.time(), events=events,
                                 data_parallel_rank=self._dp_rank)
        seq = self._zpub.publish(batch)
        if self._on_publish is not None:
            try:
                self._on_publish(seq, batch)
            except Exception:  # a hook must not stop publishing
                logger.exception("on_publish hook failed")

    def _on_local(self, ann: StoreAnnouncement) -> None:
        if ann.url != self.url:
            return
        with self._lock:
            if not self._closed:
                self._emit(self.mapper.on_records(ann.records))

    def _on_server_batch(self, batch: KVEventBatch) -> None:
        with self._lock:
            if not batch.enabled:
                logger.warning("the LMCache server stopped recording KV events")
            self._emit(self.mapper.on_batch(batch))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Forward events until :meth:`stop`; then release everything."""
        with self._lock:
            if self._running or self._closed:
                raise KVCacheSDKError("the publisher is already running or stopped")
            self._running = True
            self._run_thread = threading.current_thread()
        slice_s = 0.05 if self._zpub.replay_socket is not None else _POLL_SLICE_S
        try:
            while not self._stop_event.is_set():
                sub = self._sub
                if sub is None or not sub.active:
                    if _target_closed(self._target):
                        logger.info("the context was closed; stopping the publisher")
                        break
                    self._resubscribe(sub)
                    continue
                try:
                    batch = sub.poll(slice_s)
                except KVCacheSDKError as err:
                    logger.warning("KV event stream failed: %s", err)
                    batch = None
                if batch is not None:
                    self._on_server_batch(batch)
                self._zpub.service_replay(0.0)
        finally:
            self._cleanup()
            self._done.set()

    def _resubscribe(self, old: KVEventSubscription | None) -> None:
        reason = old.end_reason if old is not None else "not subscribed"
        if old is not None:
            old.close()
        with self._lock:
            self._emit(self.mapper.withdraw_all(f"stream ended: {reason}"))
            self.mapper.incarnation = None
        logger.warning("KV event stream ended (%s); subscribing again from cursor 0", reason)
        while not self._stop_event.is_set():
            try:
                self._sub = subscribe(self._target, cursor=0, max_events=self._max_events)
                return
            except ContextClosedError:
                self._stop_event.set()
                return
            except KVCacheSDKError as err:
                logger.warning("re-subscribing failed (%s); retrying in 1s", err)
                self._stop_event.wait(1.0)

    def start(self) -> KVEventPublisher:
        """Run :meth:`run` on a daemon thread; return self."""
        with self._lock:
            if self._thread is not None:
                raise KVCacheSDKError("the publisher was already started")
            self._thread = threading.Thread(target=self.run, daemon=True,
                                            name=f"lmcache-kv-fast-publisher-{self.model_name}")
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop forwarding and close the subscription and sockets. Idempotent.

        Safe from a signal handler on the thread that runs :meth:`run` (it then only asks
        the loop to end; the loop cleans up).
        """
        self._stop_event.set()
        if not self._running:
            self._cleanup()
            return
        runner = self._run_thread
        if runner is not None and runner is not threading.current_thread():
            if not self._done.wait(timeout):
                logger.warning("the publisher loop did not stop within %gs", timeout)
            if self._thread is not None:
                self._thread.join(timeout)

    def _cleanup(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        if self._sub is not None:
            self._sub.close()
        self._zpub.close()
        logger.info("KV event publisher for %r stopped", self.model_name)

    def __enter__(self) -> KVEventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------- CLI
def events_main(argv: list[str]) -> int:
    """``lmcache-kv-fast events`` (see :func:`lmcache_kv_fast.events_cli.events_main`)."""
    from lmcache_kv_fast.events_cli import events_main as _main

    return _main(argv)
