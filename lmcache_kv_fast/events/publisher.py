"""Republish KV events in vLLM's wire format: :class:`VllmZmqPublisher`, :class:`KVEventPublisher`.

:class:`VllmZmqPublisher` is vLLM's ``ZmqEventPublisher`` wire behaviour (ZMQ PUB multipart
``(topic, seq:8 bytes big-endian, msgpack vLLM KVEventBatch)`` plus the optional ROUTER replay
socket). :class:`KVEventPublisher` feeds it from both sources of a model's events - the
server's stream (:mod:`lmcache_kv_fast.events.stream`) and this SDK's store announcements
(:mod:`lmcache_kv_fast.events.announce`) - through one
:class:`~lmcache_kv_fast.events.vllm_format.VllmEventMapper` (docs/protocol.md §9).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from lmcache_kv_fast.errors import ContextClosedError, InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.events.announce import StoreAnnouncement, add_listener, server_hash_algorithm
from lmcache_kv_fast.events.endpoint import EventsEndpoint, target_closed
from lmcache_kv_fast.events.stream import KVEventSubscription, subscribe
from lmcache_kv_fast.events.stream_io import POLL_SLICE_S, KVEventBatch
from lmcache_kv_fast.events.vllm_format import (
    VllmEvent,
    VllmEventMapper,
    VllmKVEventBatch,
    WireFormat,
    encode_vllm_batch,
)
from lmcache_kv_fast.hashing import HASH_ALGORITHM, blake3_available
from lmcache_kv_fast.protocol.constants import MAX_EVENTS_PER_BATCH

logger = logging.getLogger("lmcache_kv_fast.events")

#: vLLM publisher defaults (``--kv-events-config``: endpoint / replay_endpoint / topic).
DEFAULT_PUBLISH = "tcp://127.0.0.1:5557"
DEFAULT_TOPIC = "kv-events"
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000


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
    """Republish a model's KV events in vLLM's wire format (docs/events.md, protocol.md §9).

    Why: the server records no ``stored`` event for SDK stores, so a router following its
    stream never sees them. This merges the server's stream with this process's store
    announcements through one :class:`VllmEventMapper` (each chunk announced once) and
    withdraws everything on a lost or ended stream or a server restart. :meth:`run`
    blocks, :meth:`start` runs it in a thread, :meth:`stop` closes; a context manager too.

    Args:
        source: A context, an :class:`EventsEndpoint`, or a ZMQ URL (with ``http_url``
            and ``model_name``).
        http_url: HTTP URL of the server when ``source`` is a URL.
        model_name: Model when ``source`` is a URL.
        publish: PUB endpoint (bound, see :class:`VllmZmqPublisher`).
        topic: Topic frame of every message.
        replay: ROUTER replay endpoint (None: no replay).
        cursor: Server cursor to start from (0: replay the retained log).
        max_events: Records per server batch.
        timeout: Probe timeout in seconds when ``source`` is a URL.
        wire_format, int_block_hashes, data_parallel_rank, buffer_steps, hwm: vLLM's
            publisher options (docs/events.md).
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
        slice_s = 0.05 if self._zpub.replay_socket is not None else POLL_SLICE_S
        try:
            while not self._stop_event.is_set():
                sub = self._sub
                if sub is None or not sub.active:
                    if target_closed(self._target):
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
