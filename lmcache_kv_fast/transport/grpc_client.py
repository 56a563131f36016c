"""gRPC client of ``lmcache server --transport grpc`` (docs/protocol.md §12).

Same surface as :mod:`~lmcache_kv_fast.transport.zmq_client` (``GrpcClient`` /
``GrpcChannel`` for ``ZmqClient`` / ``Channel``), so the flows run unchanged on either
transport. One ``grpc.Channel`` (one HTTP/2 connection) per client; every thread gets a
channel object of its own with its own in-flight table and its own random
``lmcache-client-id-bin`` metadata, the key of the server's affinity pool (as each ZMQ
DEALER socket has its own identity). A request is an RPC future
(``multicallable.future``); the flows' waits are ours, so a wait that gives up leaves the
RPC running and its late reply can still be settled (``client/late.py``). Every RPC also
carries a gRPC deadline, long enough for that (:data:`LATE_HORIZON_S`).

What gRPC changes: a failed request gets a real error reply (``ServerError``) instead of
silence; a connection that drops under a request fails it at once (``ConnectionLostError``,
a ``ServerTimeoutError``); the server runs requests on a thread pool in no particular
order (the handshake never assumes a FIFO pool over gRPC).

``grpc`` is imported on first use; without it :func:`require_grpc` raises
``MissingExtraError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_kv_fast.errors import (
    ConnectionLostError,
    ContextClosedError,
    MissingExtraError,
    ServerError,
    ServerTimeoutError,
)
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.transport import grpc_codec
from lmcache_kv_fast.transport.registry import ChannelBase, ChannelRegistry
from lmcache_kv_fast.transport.urls import parse_grpc_url
from lmcache_kv_fast.transport.zmq_client import (
    POLL_SLICE_MS,
    UIDS,
    UNRESPONSIVE_TIMEOUT_S,
    PendingCall,
)

logger = logging.getLogger(__name__)

#: Metadata key of the client id the server hashes to pick an affinity worker.
CLIENT_ID_KEY = "lmcache-client-id-bin"
#: gRPC deadline of every RPC beyond the client's timeout: a late reply is still settled
#: (late.py) while the server-side resources it holds live (the write TTL is 600 s).
LATE_HORIZON_S = 630.0
#: Install hint of the optional dependency.
EXTRA_HINT = "pip install 'lmcache-kv-fast[grpc]'"
_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 1000),
    # a channel going idle would read as a lost connection (peer_lost)
    ("grpc.client_idle_timeout_ms", 2**31 - 1),
)


def require_grpc() -> Any:
    """Import and return the ``grpc`` module.

    Raises:
        MissingExtraError: grpcio (or protobuf) is not installed.
    """
    try:
        import google.protobuf  # noqa: F401
        import grpc
    except ImportError as err:
        raise MissingExtraError(
            f"a grpc:// URL needs the optional gRPC support ({err}): {EXTRA_HINT}"
        ) from err
    return grpc


@dataclass
class GrpcCall(PendingCall):
    """A request sent on a gRPC channel: :class:`PendingCall` plus its RPC future."""

    future: Any = None


class GrpcChannel(ChannelBase):
    """One thread's view of the client: its in-flight RPCs, fired calls and affinity id."""

    def __init__(self, client: GrpcClient, *, bound: bool = True) -> None:
        super().__init__(client, bound)
        self._metadata = ((CLIENT_ID_KEY, os.urandom(16)),)
        self._inflight: dict[bytes, GrpcCall] = {}
        self._parked: set[bytes] = set()
        #: Completed calls not looked at yet (written by gRPC's threads under client.cv).
        self._arrived: dict[bytes, GrpcCall] = {}
        self._lost_seen = client.lost_count

    # -- sending ---------------------------------------------------------------------
    def send(self, op: Op, payloads: Sequence[Any] = (), *, raw: Sequence[Any] = ()) -> GrpcCall:
        """Start one RPC; return its handle (see ``Channel.send``).

        Raises:
            ContextClosedError: The client is closed.
            KeyError: The server generation has no RPC for ``op`` (never sent).
        """
        client = self._client
        method = client.dialect.method(op)
        request = method.encode(client.generation.payloads(op, payloads), raw)
        uid = next(UIDS)
        call = GrpcCall(uid, uid.to_bytes(8, "big"), op, method.path.encode(), time.monotonic())
        with client.active():
            self._inflight[call.uid_frame] = call
            try:
                call.future = client.stub(method).future(
                    request, timeout=client.call_deadline, metadata=self._metadata,
                    wait_for_ready=True)
            except BaseException:
                self._inflight.pop(call.uid_frame, None)
                raise
        call.future.add_done_callback(lambda _f, c=call: self._done(c))
        return call

    def _done(self, call: GrpcCall) -> None:
        """An RPC completed (on a gRPC thread): note it for the owning thread."""
        cv = self._client.cv
        with cv:
            if call.uid_frame in self._inflight or call.uid_frame in self._unacked:
                self._arrived[call.uid_frame] = call
                cv.notify_all()

    def fire(self, op: Op, payloads: Sequence[Any] = (), *,
             on_ack: Callable[[bytes], None] | None = None) -> bytes:
        """Send a request whose reply nobody waits for (see ``Channel.fire``)."""
        call = self.send(op, payloads)
        with self._client.cv:
            self._inflight.pop(call.uid_frame, None)
            self._unacked[call.uid_frame] = call
            if on_ack is not None:
                self._on_ack[call.uid_frame] = on_ack
            if call.future.done():
                self._arrived[call.uid_frame] = call
        return call.uid_frame

    def collect(self, timeout_ms: int = 0) -> None:
        """Consume the replies that arrived (waiting up to ``timeout_ms`` for the first)."""
        if not self._arrived and timeout_ms > 0:
            with self._client.cv:
                self._client.cv.wait_for(lambda: bool(self._arrived), timeout_ms / 1000)
        if self._arrived:
            self._drain()

    def forget_unacked(self) -> None:
        """Drop every fired call (their requests were lost with the connection)."""
        with self._client.cv:
            for uid in self._unacked:
                self._arrived.pop(uid, None)
            self._unacked.clear()
            self._on_ack.clear()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the replies of fired calls; True when none is left."""
        deadline = time.monotonic() + timeout
        while self._unacked:
            if self.peer_lost():
                self.forget_unacked()
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.collect(max(1, min(int(remaining * 1000) + 1, POLL_SLICE_MS)))
        return True

    def _drain(self) -> None:
        """Acknowledge the fired calls that completed; park the awaited ones."""
        with self._client.cv:
            arrived, self._arrived = self._arrived, {}
        for uid, call in arrived.items():
            if _succeeded(call):
                self.unresponsive = False  # the server is alive (even a late reply says so)
            if self._unacked.pop(uid, None) is not None:
                err = call.future.exception() if not call.future.cancelled() else None
                if err is not None:
                    logger.debug("fired %s failed: %s", call.op.value, err)
                cb = self._on_ack.pop(uid, None)
                if cb is not None:
                    cb(uid)
            elif uid in self._inflight:
                self._parked.add(uid)

    # -- receiving -------------------------------------------------------------------
    def wait(self, call: PendingCall, resp_type: Any = None, timeout: float | None = None) -> Any:
        """Wait for the reply of ``call`` and decode it (see ``Channel.wait``).

        Raises:
            ServerTimeoutError: No reply in time (``ConnectionLostError``: the connection
                dropped under it).
            ServerError: The server answered with an error status.
            ProtocolError: The reply does not fit ``resp_type``.
            ContextClosedError: The client was closed while waiting.
        """
        assert isinstance(call, GrpcCall)
        client = self._client
        timeout = client.timeout if timeout is None else timeout
        shortened = self.unresponsive and timeout > UNRESPONSIVE_TIMEOUT_S
        if shortened:
            timeout = UNRESPONSIVE_TIMEOUT_S
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        try:
            with client.active():
                self._wait_for(call, timeout, deadline)
        except ServerTimeoutError as err:
            if not shortened:
                raise
            raise ServerTimeoutError(
                f"{err} [a short wait: an earlier call of this operation already got no reply]"
            ) from None
        finally:
            self._consume(call)
            self.wait_s += time.perf_counter() - t0
            self.waits += 1
        return self._result(call, resp_type)

    def _wait_for(self, call: GrpcCall, timeout: float, deadline: float) -> None:
        grpc = require_grpc()
        fut = call.future
        while not fut.done():
            if self._client.closing:
                raise ContextClosedError(
                    f"context closed while waiting for {call.op.value} on {self._client.url}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.unresponsive = True
                raise ServerTimeoutError(self._client.timeout_message(call.op, timeout))
            with contextlib.suppress(grpc.FutureTimeoutError, grpc.FutureCancelledError):
                fut.exception(timeout=min(remaining, POLL_SLICE_MS / 1000))

    def _consume(self, call: GrpcCall) -> None:
        with self._client.cv:
            self._inflight.pop(call.uid_frame, None)
            self._arrived.pop(call.uid_frame, None)
            self._parked.discard(call.uid_frame)

    def _result(self, call: GrpcCall, resp_type: Any) -> Any:
        grpc = require_grpc()
        try:
            msg = call.future.result(timeout=0)
        except grpc.FutureCancelledError:
            raise ContextClosedError(
                f"{call.op.value} on {self._client.url} was cancelled: the context closed"
            ) from None
        except grpc.RpcError as err:
            exc = self._client.rpc_error(call.op, err)
            if isinstance(exc, ServerTimeoutError):
                self.unresponsive = True
            raise exc from None
        self.unresponsive = False
        method = self._client.dialect.method(call.op)
        return grpc_codec.to_type(method.decode(msg), resp_type, call.op.value)

    def ready(self, call: PendingCall) -> bool:
        """Whether the reply of ``call`` has arrived (never blocks; consumes acknowledgements)."""
        if self._arrived:
            self._drain()
        fut = getattr(call, "future", None)
        return fut is not None and fut.done()

    def expect(self, call: PendingCall) -> None:
        """Wait for ``call``'s reply again (after its wait timed out)."""
        assert isinstance(call, GrpcCall)
        with self._client.cv:
            self._inflight[call.uid_frame] = call
            if call.future is not None and call.future.done():
                self._arrived[call.uid_frame] = call
                self._client.cv.notify_all()

    def discard(self, call: PendingCall) -> None:
        """Forget ``call``: its reply is dropped (the RPC keeps running on the server)."""
        assert isinstance(call, GrpcCall)
        self._consume(call)

    def peer_lost(self) -> bool:
        """Whether the connection dropped since this channel last asked, or is down now.

        While it is down nothing sent on it reaches a server; RPCs queued for the
        reconnection (``wait_for_ready``) are cancelled when the channel is dropped, so
        a restarted server never runs them (unlike a ZMQ socket's queue).
        """
        client = self._client
        n = client.lost_count
        lost, self._lost_seen = n != self._lost_seen, n
        return lost or client.down

    @property
    def readable(self) -> bool:
        """A completion is waiting to be looked at (``GrpcClient.poll``)."""
        return bool(self._arrived)

    def close(self) -> None:
        """Cancel this channel's RPCs still running (their replies would be dropped)."""
        with self._client.cv:
            calls = [*self._inflight.values(), *self._unacked.values()]
            self._inflight.clear()
            self._unacked.clear()
            self._arrived.clear()
            self._parked.clear()
        for c in calls:
            if c.future is not None:
                c.future.cancel()


def _succeeded(call: GrpcCall) -> bool:
    fut = call.future
    return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None


class GrpcClient(ChannelRegistry["GrpcChannel"]):
    """Control-plane client over gRPC: per-thread channels over one ``grpc.Channel``.

    Args:
        url: ``grpc://host:port`` or ``grpc+unix:///path`` (``transport/urls.py``).
        generation: Wire dialect of the server (0.5.6 or 0.5.7).
        timeout: Default seconds every call waits for its reply.

    Raises:
        InvalidArgumentError: ``url`` is not a gRPC URL.
        MissingExtraError: grpcio is not installed.
        KVCacheSDKError: ``generation`` has no gRPC dialect this SDK speaks.
    """

    def __init__(self, url: str, generation: Generation, timeout: float) -> None:
        self.endpoint = parse_grpc_url(url)  # before anything is created
        grpc = require_grpc()
        self.dialect = grpc_codec.dialect_for(generation)
        self.url = url
        self.generation = generation
        self.timeout = float(timeout)
        self.call_deadline = self.timeout + LATE_HORIZON_S
        #: Set by the handshake when a newer server is spoken to in the newest dialect.
        self.tried_dialect: str | None = None
        super().__init__()
        #: Completions of every channel's RPCs are announced here (poll, collect).
        self.cv = threading.Condition()
        #: Times the connection left READY (each channel's peer_lost compares).
        self.lost_count = 0
        #: The connection was READY once and is not now (killed, restarting server).
        self.down = False
        self._was_ready = False
        self._stubs: dict[str, Any] = {}
        self._grpc = grpc
        self._channel = grpc.insecure_channel(self.endpoint.grpc_target, options=_OPTIONS)
        self._channel.subscribe(self._on_state, try_to_connect=False)

    def _make_channel(self, bound: bool) -> GrpcChannel:
        # Channels of finished threads are forgotten, not closed (ChannelRegistry._keep):
        # cancelling an RPC the server has not started yet (a fired end_session) drops it.
        return GrpcChannel(self, bound=bound)

    def _on_state(self, state: Any) -> None:
        """Connectivity change (gRPC thread): leaving READY is a lost connection."""
        ready = self._grpc.ChannelConnectivity.READY
        with self.cv:
            if state == ready:
                self._was_ready = True
                self.down = False
            elif self._was_ready:
                self._was_ready = False
                self.down = True
                self.lost_count += 1
                logger.info("gRPC connection to %s left READY (%s)", self.url, state)
            self.cv.notify_all()

    def stub(self, method: grpc_codec.Method) -> Any:
        """The multicallable of ``method`` (created once per client)."""
        st = self._stubs.get(method.path)
        if st is None:
            make = self._channel.unary_stream if method.streaming else self._channel.unary_unary
            st = make(method.path, request_serializer=method.request.SerializeToString,
                      response_deserializer=method.response.FromString)
            self._stubs[method.path] = st
        return st

    def rpc_error(self, op: Op, err: Any) -> Exception:
        """The SDK error of a failed RPC (``err``: ``grpc.RpcError``)."""
        code = err.code()
        name = getattr(code, "name", str(code))
        details = err.details() or ""
        sc = self._grpc.StatusCode
        if code == sc.DEADLINE_EXCEEDED:
            return ServerTimeoutError(self.timeout_message(op, self.call_deadline))
        if code == sc.UNAVAILABLE:
            return ConnectionLostError(
                f"{op.value} to {self.url} failed: the connection to the server dropped "
                f"(UNAVAILABLE: {details}). The server was killed, restarted or became "
                "unreachable; a restarted server has forgotten this client: reconnect with "
                "connect()")
        if code == sc.CANCELLED and self.closing:
            return ContextClosedError(f"{op.value} on {self.url} was cancelled: the context closed")
        if code == sc.UNIMPLEMENTED:
            msg = (f"the server at {self.url} does not serve {op.value} (UNIMPLEMENTED: "
                   f"{details}); start it with --supported-transfer-mode auto")
        elif code == sc.UNKNOWN:
            msg = f"{op.value} failed on the server at {self.url}: {details}"
        else:
            msg = f"{op.value} to {self.url} failed with gRPC status {name}: {details}"
        if self.tried_dialect is not None:
            msg += f" ({self.tried_dialect}: upgrade lmcache-kv-fast for that server)"
        exc = ServerError(msg)
        exc.code = name
        return exc

    def poll(self, channels: Sequence[GrpcChannel], timeout_s: float) -> set[GrpcChannel]:
        """Wait up to ``timeout_s`` for a completion on any of ``channels``; return those with one."""
        with self.cv:
            self.cv.wait_for(lambda: any(c.readable for c in channels), max(timeout_s, 0.0))
            return {c for c in channels if c.readable}

    def timeout_message(self, op: Op, timeout: float) -> str:
        """Explain a timeout of ``op``."""
        return (
            f"{op.value} to {self.url} got no reply within {timeout:g}s. Likely causes: the "
            "server is not running or not reachable at that URL (gRPC keeps trying to "
            "connect); the server was restarted or killed (a restarted server has forgotten "
            "this client: reconnect with connect()); or it is frozen or overloaded "
            f"(server generation {self.generation.name}, gRPC transport)"
        )

    def close(self) -> None:
        """Cancel what is in flight and close the gRPC channel. Idempotent."""
        if not self._close_channels():
            return
        with contextlib.suppress(Exception):
            self._channel.unsubscribe(self._on_state)
        # gRPC's connectivity poller (0.2 s slices) raises "Channel closed!" from its
        # thread when the channel closes under it: close once it has stopped.
        threading.Thread(target=_close_when_unwatched, args=(self._channel,),
                         name="lmcache-kv-fast-grpc-close", daemon=True).start()

def _close_when_unwatched(channel: Any, limit_s: float = 2.0) -> None:
    """Close ``channel`` once its connectivity poller thread has exited (or ``limit_s``)."""
    state = getattr(channel, "_connectivity_state", None)
    deadline = time.monotonic() + limit_s
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.05)
    channel.close()

