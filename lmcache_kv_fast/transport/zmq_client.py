"""ZMQ DEALER client of the server's ROUTER (docs/protocol.md §2).

Design: every thread that uses a context gets its own DEALER socket (a ``Channel``),
so no lock is held around socket I/O and a single-threaded caller sends and receives on
its own thread with no hand-off. Within one channel any number of requests may be in
flight; replies are matched by uid, replies for other in-flight uids are parked, and late
replies of timed-out requests are dropped. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from lmcache_kv_fast.errors import (
    ContextClosedError,
    ProtocolError,
    ServerTimeoutError,
)
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.transport.registry import ChannelBase, ChannelRegistry
from lmcache_kv_fast.transport.urls import parse_zmq_url
from lmcache_kv_fast.transport.zmq_socket import CHANNEL_OPTIONS, Dealer

logger = logging.getLogger(__name__)

_NONE = object()  # marker: a 2-frame reply (handler returned None)
POLL_SLICE_MS = 100  # wake up this often to notice close()
#: After a call of a channel timed out, its later waits (cleanup of the same operation:
#: commit / free_lookup_locks / end_session ...) give up after this long, until the server
#: is heard from again, so a dead server costs one timeout per operation, not one per call.
UNRESPONSIVE_TIMEOUT_S = 0.5

# uids are unique per process (and so per socket); start at a random point so two
# processes never look alike in server logs.
UIDS = itertools.count(int.from_bytes(os.urandom(3), "big"))


@dataclass
class PendingCall:
    """A request sent on a channel whose reply has not been consumed yet."""

    uid: int
    uid_frame: bytes
    op: Op
    op_frame: bytes
    sent_at: float


class Channel(ChannelBase):
    """One DEALER socket, used by one thread only."""

    def __init__(self, client: ZmqClient, *, bound: bool = True) -> None:
        super().__init__(client, bound)
        # Disconnects (server killed or restarted) are noticed by its monitor; see peer_lost().
        self._dealer = Dealer(client.zmq_context, client.endpoint, options=CHANNEL_OPTIONS,
                              send_timeout=client.timeout)
        self.sock: zmq.Socket = self._dealer.sock
        self._inflight: dict[bytes, PendingCall] = {}
        self._parked: dict[bytes, list[Any]] = {}

    # -- sending ---------------------------------------------------------------------
    def send(self, op: Op, payloads: Sequence[Any] = (), *, raw: Sequence[bytes] = ()) -> PendingCall:
        """Send one request; return its handle.

        Args:
            op: The operation.
            payloads: Payload values, each encoded as its own msgpack frame.
            raw: Already-encoded payload frames appended after ``payloads``.

        Raises:
            ContextClosedError: The client is closed.
            KeyError: The server generation does not have ``op`` (never sent).
            ServerUnavailableError: No connection takes the message (``Dealer.send``).
        """
        gen = self._client.generation
        op_value = gen.op_frame_value(op)
        uid = next(UIDS)
        uid_frame = codec.encode(uid)
        op_frame = codec.encode(op_value)
        frames: list[Any] = [uid_frame, op_frame]
        frames.extend(codec.encode(p) for p in gen.payloads(op, payloads))
        frames.extend(raw)
        # Never fewer than 2 frames: a 1-frame message kills the server's loop (docs/protocol.md §2.7).
        assert len(frames) >= 2
        call = PendingCall(uid, uid_frame, op, op_frame, time.monotonic())
        with self._client.active():
            self._inflight[uid_frame] = call
            try:
                self._dealer.send(frames, op.value, copy=len(frames[-1]) < 65536)
            except BaseException:
                del self._inflight[uid_frame]
                raise
        return call

    def fire(self, op: Op, payloads: Sequence[Any] = (), *,
             on_ack: Callable[[bytes], None] | None = None) -> bytes:
        """Send a request whose reply nobody waits for (a release such as ``end_session``).

        The reply is consumed whenever this channel next receives; :meth:`settle` waits
        for the outstanding ones (before the socket closes, so nothing is lost).

        Args:
            op: The operation.
            payloads: Its payloads.
            on_ack: Called with the call's uid frame when the reply is consumed (on the
                thread that receives it).

        Returns:
            The call's uid frame.
        """
        call = self.send(op, payloads)
        self._inflight.pop(call.uid_frame, None)
        self._unacked[call.uid_frame] = call
        if on_ack is not None:
            self._on_ack[call.uid_frame] = on_ack
        return call.uid_frame

    def collect(self, timeout_ms: int = 0) -> None:
        """Consume the replies that arrived (waiting up to ``timeout_ms`` for the first)."""
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            self._drain()

    def forget_unacked(self) -> None:
        """Drop every fired call (their requests were lost with the connection)."""
        self._unacked.clear()
        self._on_ack.clear()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the replies of fired calls; True when none is left."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(zmq.ZMQError):
            while self._unacked:
                if self.peer_lost():  # the server went away: those requests are lost
                    self.forget_unacked()
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if self.sock.poll(max(1, min(int(remaining * 1000) + 1, POLL_SLICE_MS)),
                                  zmq.POLLIN):
                    self._drain()
        return not self._unacked

    # -- receiving -------------------------------------------------------------------
    def wait(self, call: PendingCall, resp_type: Any = None, timeout: float | None = None) -> Any:
        """Wait for the reply of ``call`` and decode it.

        Args:
            call: The handle returned by :meth:`send`.
            resp_type: msgspec type of a 3-frame reply, or None to accept any.
            timeout: Seconds to wait; the client's default when None.

        Returns:
            The decoded value, or None for a 2-frame reply.

        Raises:
            ServerTimeoutError: No reply in time (the server sends no error replies).
            ProtocolError: The reply is malformed (wrong op echo, extra frames, bad msgpack).
            ContextClosedError: The client was closed while waiting.
        """
        timeout = self._client.timeout if timeout is None else timeout
        shortened = self.unresponsive and timeout > UNRESPONSIVE_TIMEOUT_S
        if shortened:
            timeout = UNRESPONSIVE_TIMEOUT_S
        deadline = time.monotonic() + timeout
        key = call.uid_frame
        t0 = time.perf_counter()
        try:
            with self._client.active():
                self._wait_for(call, key, timeout, deadline)
        except ServerTimeoutError as err:
            if not shortened:
                raise
            raise ServerTimeoutError(
                f"{err} [a short wait: an earlier call of this operation already got no reply]"
            ) from None
        finally:
            self._inflight.pop(key, None)
            self.wait_s += time.perf_counter() - t0
            self.waits += 1
        frames = self._parked.pop(key)
        if frames[1] != call.op_frame:
            raise ProtocolError(
                f"reply to {call.op.value} on {self._client.url} echoed operation frame "
                f"{bytes(frames[1])!r}, expected {call.op_frame!r}"
            )
        if len(frames) == 2:
            return None
        if len(frames) != 3:
            raise ProtocolError(
                f"reply to {call.op.value} on {self._client.url} has {len(frames)} frames, "
                "expected 2 or 3"
            )
        if resp_type is None:
            return codec.decode(frames[2], Any, what=call.op.value)
        return codec.decode(frames[2], resp_type, what=call.op.value)

    def _wait_for(self, call: PendingCall, key: bytes, timeout: float, deadline: float) -> None:
        while key not in self._parked:
            if self._client.closing:
                raise ContextClosedError(
                    f"context closed while waiting for {call.op.value} on {self._client.url}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.unresponsive = True
                raise ServerTimeoutError(self._client.timeout_message(call.op, timeout))
            wait_ms = max(1, min(int(remaining * 1000) + 1, POLL_SLICE_MS))
            # a blocking receive (one slice at most): ~20 us of CPU less per reply than
            # polling, then receiving without blocking (docs/performance.md)
            frames = self._dealer.receive_within(wait_ms)
            if frames is not None:
                self._take(frames)

    def _drain(self) -> None:
        """Receive every reply available now; park those of in-flight uids."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._take(frames)

    def _take(self, frames: list[zmq.Frame]) -> None:
        """One received reply: an acknowledgement, parked for its waiter, or dropped."""
        self.unresponsive = False  # the server is alive (even a late reply says so)
        uid_frame = frames[0].bytes if frames else b""
        if self._unacked.pop(uid_frame, None) is not None:
            cb = self._on_ack.pop(uid_frame, None)
            if cb is not None:
                cb(uid_frame)
            return  # the acknowledgement of a fired call
        if uid_frame not in self._inflight:
            logger.debug("dropping a reply for unknown or timed-out uid %r", uid_frame[:16])
            return
        parts: list[Any] = [uid_frame, frames[1].bytes if len(frames) > 1 else b""]
        parts.extend(f.buffer for f in frames[2:])
        self._parked[uid_frame] = parts

    def ready(self, call: PendingCall) -> bool:
        """Whether the reply of ``call`` has arrived (never blocks; receives what is there)."""
        if call.uid_frame not in self._parked and self.sock.poll(0, zmq.POLLIN):
            self._drain()
        return call.uid_frame in self._parked

    def expect(self, call: PendingCall) -> None:
        """Wait for ``call``'s reply again (after its wait timed out): park it when it comes."""
        self._inflight[call.uid_frame] = call

    def discard(self, call: PendingCall) -> None:
        """Forget ``call``: a reply that still arrives is dropped."""
        self._inflight.pop(call.uid_frame, None)
        self._parked.pop(call.uid_frame, None)

    def peer_lost(self) -> bool:
        """Whether the connection to the server dropped since the last call.

        It drops when the server is killed or restarted; the socket reconnects by itself.
        """
        return bool(self._dealer.connection_events())

    def close(self) -> None:
        """Close the socket (only from the owning thread or after it is gone)."""
        self._dealer.close()


class ZmqClient(ChannelRegistry[Channel]):
    """Control-plane client: per-thread channels over one ZMQ context.

    Args:
        url: ZMQ endpoint, e.g. ``tcp://127.0.0.1:5555`` (``transport/urls.py``).
        generation: Wire dialect of the server (operation ids).
        timeout: Default seconds every call waits for its reply.

    Raises:
        InvalidArgumentError: ``url`` is not a ZMQ URL this client can connect to.
    """

    def __init__(self, url: str, generation: Generation, timeout: float) -> None:
        self.endpoint = parse_zmq_url(url)  # before anything is created
        self.url = url
        self.generation = generation
        self.timeout = float(timeout)
        super().__init__()
        self.zmq_context = zmq.Context()
        #: Set when the dialect is the newest one tried on a newer, unknown server.
        self.tried_dialect: str | None = None

    def _make_channel(self, bound: bool) -> Channel:
        return Channel(self, bound=bound)

    def _keep(self, ch: Channel, alive: set[int]) -> bool:
        """A finished thread's channel is closed (its socket would outlive the thread)."""
        if not ch.owner or ch.owner in alive:
            return True
        ch.close()
        return False

    def poll(self, channels: Sequence[Channel], timeout_s: float) -> set[Channel]:
        """Wait up to ``timeout_s`` for a reply on any of ``channels``; return those with one.

        Raises:
            zmq.ZMQError: A socket was closed under the poll (``close()`` runs).
        """
        poller = zmq.Poller()
        for ch in channels:
            poller.register(ch.sock, zmq.POLLIN)
        ready = dict(poller.poll(max(0, int(timeout_s * 1000))))
        return {ch for ch in channels if ch.sock in ready}

    def timeout_message(self, op: Op, timeout: float) -> str:
        """Explain a timeout of ``op`` (the server never sends error replies)."""
        if self.tried_dialect is not None:
            return (
                f"{op.value} to {self.url} got no reply within {timeout:g}s: the server "
                f"answers but may not understand this request ({self.tried_dialect}; it "
                "sends no error replies, see its log). Upgrade lmcache-kv-fast for that server"
            )
        return (
            f"{op.value} to {self.url} got no reply within {timeout:g}s. Likely causes: the "
            "server is not running or not reachable at that URL; the server was restarted or "
            "killed (a restarted server has forgotten this client: reconnect with connect()); "
            "the operation is not enabled (start the server with "
            "--supported-transfer-mode auto or engine_driven); or the server rejected the "
            f"request (server generation {self.generation.name}; it sends no error replies, "
            "see its log)"
        )

    def close(self) -> None:
        """Close every channel and the ZMQ context. Idempotent."""
        if self._close_channels():
            self.zmq_context.term()


def decode_any(frame: bytes) -> Any:
    """Decode an untyped msgpack frame.

    Raises:
        ProtocolError: Not msgpack, or nested too deeply.
    """
    return codec.decode(frame, Any, what="a frame")
