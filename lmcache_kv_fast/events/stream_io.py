"""The wire half of a KV-event subscription: frames in, batches out (docs/protocol.md §2.2, §2.6).

:class:`KVEventBatch` is what a subscription yields (the server's
:class:`~lmcache_kv_fast.protocol.types.WireKVEventBatch` plus ``incarnation_changed``);
:class:`StreamIO` is the base of :class:`~lmcache_kv_fast.events.stream.KVEventSubscription`
that speaks the wire over a :class:`~lmcache_kv_fast.transport.zmq_socket.Dealer`: the
``get_experimental`` capability probe, ``subscribe_kv_events`` requests, ack / cancel
frames, disconnect / reconnect (resubscribe at the received cursor), end markers, and the
incarnation check after a reconnect. Its state is one :class:`WireState`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import zmq

from lmcache_kv_fast.errors import (
    InvalidArgumentError,
    KVCacheSDKError,
    ProtocolError,
    ServerTimeoutError,
)
from lmcache_kv_fast.events.common import KV_EVENT_CAPABILITY
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol import types as _wire
from lmcache_kv_fast.protocol.constants import STREAM_ACK, STREAM_CANCEL
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.transport.zmq_socket import Dealer

logger = logging.getLogger("lmcache_kv_fast.events")

#: The consumer wakes this often while waiting, to notice close() and a closed context.
POLL_SLICE_S = 0.1

UIDS = itertools.count(int.from_bytes(os.urandom(3), "big") << 8)


class KVEventBatch(_wire.WireKVEventBatch, kw_only=True):
    """One batch of the server's KV event stream (docs/protocol.md §4.5), as the subscription yields it.

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



def stream_control(uid_frame: bytes, action: bytes) -> list[bytes]:
    """A stream control message ``[uid, b"", action]`` (``ack`` / ``cancel``, docs/protocol.md §2.2).

    Args:
        uid_frame: The subscribe request's uid frame, byte for byte.
        action: ``b"ack"`` or ``b"cancel"``.
    """
    if action not in (STREAM_ACK, STREAM_CANCEL):
        raise InvalidArgumentError(f"stream control must be ack or cancel, got {action!r}")
    return [uid_frame, b"", action]


def send_stream_control(sock: zmq.Socket, uid_frame: bytes, action: bytes) -> None:
    """Send :func:`stream_control` on ``sock``, the DEALER the subscribe request went out on."""
    sock.send_multipart(stream_control(uid_frame, action))


@dataclass
class WireState:
    """Where a subscription's stream stands on the wire (used under its lock)."""

    #: Cursor of the last ``subscribe_kv_events`` sent.
    sent_cursor: int
    #: ``next_cursor`` of the last batch received (where a resubscription starts).
    recv_cursor: int
    #: uid frame of the live subscribe request (None: none, e.g. while disconnected).
    stream_uid: bytes | None = None
    #: The next batch is the first after a reconnection: check the incarnation.
    check_resync: bool = False
    #: The connection dropped: resubscribe once it is back.
    need_resubscribe: bool = False
    #: Incarnation of the last batch received.
    last_incarnation: int | None = None
    #: A received batch not handed out yet, with its uid frame.
    pending: tuple[bytes, KVEventBatch] | None = None
    #: uid frame of the batch handed out last (acknowledged when the next is asked for).
    unacked_uid: bytes | None = None
    #: ``cancel`` was sent / its end marker came back.
    cancelling: bool = False
    cancel_done: bool = False
    #: The request-reply call in flight (the capability probe) and its reply frames.
    call_uid: bytes | None = None
    call_reply: list[bytes] | None = None


class StreamIO:
    """Wire work of a subscription; the subclass owns the state and the lock.

    :class:`~lmcache_kv_fast.events.stream.KVEventSubscription` creates every attribute
    below in its ``__init__`` and calls these methods while holding its lock.
    """

    url: str
    model_name: str
    instance_id: int
    max_events: int
    end_reason: str | None
    _gen: Generation
    _conn: Dealer | None
    _op_frame: bytes
    _closed: bool
    _ended: bool
    _error: KVCacheSDKError | None
    _w: WireState

    def _open(self, cursor: int, probe: float) -> None:
        """Probe the capability, subscribe at ``cursor`` and wait for the first batch.

        Raises:
            KVCacheSDKError: No event stream there, or no reply / batch within ``probe``.
        """
        self._check_capability(probe)
        self._send_subscribe(cursor)
        deadline = time.monotonic() + probe
        while self._w.pending is None and not self._ended and self._error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVCacheSDKError(
                    f"subscribe_kv_events on {self.url} got no first batch within "
                    f"{probe:g}s (the server sends one at once; see its log)"
                )
            self._pump(min(left, POLL_SLICE_S))
        if self._error is not None:
            raise self._error

    def _send(self, frames: list[bytes]) -> None:
        assert self._conn is not None
        self._conn.send(frames, "a KV-event stream request")

    def _check_capability(self, probe: float) -> None:
        uid = codec.encode(next(UIDS))
        self._w.call_uid, self._w.call_reply = uid, None
        self._send([uid, codec.encode(self._gen.op_frame_value(Op.GET_EXPERIMENTAL))])
        deadline = time.monotonic() + probe
        while self._w.call_reply is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVCacheSDKError(
                    f"get_experimental on {self.url} got no reply within {probe:g}s: the "
                    "server is not reachable there or is older than LMCache 0.5.6"
                )
            self._pump(min(left, POLL_SLICE_S))
        frames, self._w.call_uid, self._w.call_reply = self._w.call_reply, None, None
        caps = codec.decode(frames[2], list[str], what="get_experimental") \
            if len(frames) == 3 else []
        # 0.5.7 lists only module features; a stream of a server without events then
        # ends with its first batch (``enabled`` false).
        if self._gen.events_capability and KV_EVENT_CAPABILITY not in caps:
            raise KVCacheSDKError(
                f"the LMCache server at {self.url} does not record KV events (get_experimental "
                f"= {caps!r}); start it without --kv-event-log-size 0 and without "
                "--disable-observability"
            )

    def _send_subscribe(self, cursor: int, *, resync: bool = False) -> None:
        uid = codec.encode(next(UIDS))
        self._send([
            uid, self._op_frame, codec.encode(self.instance_id), codec.encode(self.model_name),
            codec.encode(cursor), codec.encode(self.max_events),
        ])
        self._w.stream_uid = uid
        self._w.sent_cursor = cursor
        self._w.check_resync = resync

    def _pump(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` and handle the connection events and frames that came."""
        conn = self._conn
        assert conn is not None
        conn.wait(wait_s)
        for event in conn.connection_events():
            self._on_monitor(event)
        while (frames := conn.receive()) is not None:
            self._on_frames(frames)

    def _on_monitor(self, event: int) -> None:
        if self._closed or self._w.cancelling or self._ended:
            return
        if event == zmq.EVENT_DISCONNECTED:
            if not self._w.need_resubscribe:
                logger.warning("KV event stream: lost the connection to %s; resubscribing at "
                               "cursor %d when it is back", self.url, self._w.recv_cursor)
            self._w.stream_uid = None
            self._w.unacked_uid = None
            self._w.need_resubscribe = True
        elif event == zmq.EVENT_CONNECTED and self._w.need_resubscribe:
            self._w.need_resubscribe = False
            logger.info("KV event stream: reconnected to %s; resubscribing", self.url)
            self._send_subscribe(self._w.recv_cursor, resync=True)

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        uid = frames[0]
        if uid == self._w.call_uid:
            self._w.call_reply = frames
            return
        if uid != self._w.stream_uid:
            logger.debug("KV event stream: dropping a frame of an old stream")
            return
        if frames[1] != self._op_frame:
            logger.warning("KV event stream: reply echoed operation %r, ignoring it",
                           frames[1][:40])
            return
        if len(frames) == 2:  # end marker
            self._w.stream_uid = None
            if self._w.cancelling:
                self._w.cancel_done = True
            else:
                self._ended = True
                self.end_reason = (
                    "the server ended the stream (a newer subscription with the same "
                    "instance_id, the reaper, or KV events disabled)"
                )
                logger.info("KV event stream of %r on %s ended by the server",
                            self.model_name, self.url)
            return
        if self._w.cancelling:
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
        prev = self._w.last_incarnation
        changed = prev is not None and batch.incarnation != prev
        if self._w.check_resync:
            self._w.check_resync = False
            if changed and self._w.sent_cursor != 0:
                logger.warning(
                    "KV event stream: the server at %s restarted (incarnation %d -> %d); "
                    "restarting the stream at cursor 0", self.url, prev, batch.incarnation)
                self._send_subscribe(0)  # replaces this stream; its end marker is dropped
                return
            if not changed and not batch.events and not batch.lost and batch.enabled:
                # Reconnected to the same server and nothing is new: no batch to surface,
                # but the credit must be returned for the stream to go on.
                self._w.recv_cursor = batch.next_cursor
                self._send(stream_control(uid, STREAM_ACK))
                return
        batch.incarnation_changed = changed
        self._w.last_incarnation = batch.incarnation
        self._w.recv_cursor = batch.next_cursor
        self._w.pending = (uid, batch)
        if not batch.enabled:
            logger.warning("the LMCache server at %s reports KV events disabled", self.url)
