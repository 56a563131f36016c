"""The DEALER sockets this SDK opens to a server's ROUTER: options, connection monitor, close.

A control-plane channel (:class:`~lmcache_kv_fast.transport.zmq_client.Channel`) and the
KV-event stream (``events/stream.py``) both talk to the server over a :class:`Dealer`, so
``LINGER``, IPv6 literals, the monitor that notices a dropped connection and a close that
never leaves ``zmq_ctx_term()`` waiting are one implementation. What differs between them
is the option set (:data:`CHANNEL_OPTIONS`, :data:`STREAM_OPTIONS`) and which connection
events they watch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache_kv_fast.errors import InvalidArgumentError, ServerUnavailableError
from lmcache_kv_fast.transport.urls import Endpoint, parse_zmq_url

#: A control-plane channel: no high-water marks, so a pipelined call never blocks a send.
CHANNEL_OPTIONS: tuple[tuple[int, int], ...] = ((zmq.RCVHWM, 0), (zmq.SNDHWM, 0))
#: A long-lived stream: reconnect within 0.1..1 s, and ZMTP heartbeats (every 2 s, 6 s
#: timeout) so that a silently dead server becomes a disconnect event.
STREAM_OPTIONS: tuple[tuple[int, int], ...] = (
    (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 1000),
    (zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 6000),
)


class Dealer:
    """A DEALER connected to one server, with the monitor of its connection.

    Args:
        zctx: The ZMQ context the socket belongs to (closed before it is terminated).
        endpoint: Server URL or parsed :class:`~lmcache_kv_fast.transport.urls.Endpoint`.
        options: ``(option, value)`` pairs set after ``LINGER=0``, before connecting.
        events: Connection events to watch (``zmq.EVENT_*`` bits; 0: no monitor).
        send_timeout: Longest a :meth:`send` may block, in seconds (see there).

    Raises:
        InvalidArgumentError: ZMQ refuses the address (the sockets are closed again).
    """

    def __init__(self, zctx: zmq.Context, endpoint: Endpoint | str, *,
                 options: Sequence[tuple[int, int]] = (),
                 events: int = zmq.EVENT_DISCONNECTED, send_timeout: float = 5.0) -> None:
        self.monitor: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._rcvtimeo = -1  # the socket's RCVTIMEO (ms; -1: ZMQ's default, forever)
        self.url = endpoint if isinstance(endpoint, str) else endpoint.url
        self.send_timeout = max(0.001, float(send_timeout))
        self.sock: zmq.Socket = zctx.socket(zmq.DEALER)
        try:
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout * 1000) or 1)
            for opt, val in options:
                self.sock.setsockopt(opt, val)
            if events:
                self.monitor = self.sock.get_monitor_socket(events)
            connect_socket(self.sock, endpoint)
        except BaseException:
            # An open socket would make zmq_ctx_term() block forever.
            self.close()
            raise

    def send(self, frames: Sequence[Any], what: str, copy: bool = True) -> None:
        """Send one message, blocking at most ``send_timeout``.

        A DEALER queues messages on its connection even before it is up, but a peer that
        is not a ZMQ server (one that speaks first, like gRPC's HTTP/2) fails the handshake
        and ZMQ drops that connection for good; a send then has nowhere to go and would
        block forever.

        Raises:
            ServerUnavailableError: Nothing took the message within ``send_timeout``.
        """
        try:
            self.sock.send_multipart(frames, copy=copy)
        except zmq.Again:
            raise ServerUnavailableError(
                f"{what} could not be sent to {self.url} within {self.send_timeout:g}s: no "
                "connection there takes ZMQ messages (the peer is not an LMCache ZMQ server, "
                "or it dropped the connection); check the URL and the server's transport"
            ) from None

    def connection_events(self) -> list[int]:
        """The watched connection events (``zmq.EVENT_*``) since the last look; never blocks."""
        out: list[int] = []
        while self.monitor is not None:
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append(int(msg["event"]))
        return out

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until a message or a connection event is there."""
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(self.sock, zmq.POLLIN)
            if self.monitor is not None:
                self._poller.register(self.monitor, zmq.POLLIN)
        self._poller.poll(max(0, int(timeout_s * 1000)))

    def receive(self) -> list[bytes] | None:
        """The next message if one is there (never blocks)."""
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def receive_within(self, timeout_ms: int) -> list[zmq.Frame] | None:
        """The next message (its frames, not copied), waiting up to ``timeout_ms``; None.

        Blocks in ZMQ's receive (GIL released) under ``RCVTIMEO``: the non-blocking
        receives (:meth:`receive`) are not affected by it.
        """
        if timeout_ms != self._rcvtimeo:
            self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        try:
            return self.sock.recv_multipart(copy=False)
        except zmq.Again:
            return None

    def close(self) -> None:
        """Close the monitor and the socket. Idempotent."""
        mon, self.monitor = self.monitor, None
        if mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            with contextlib.suppress(zmq.ZMQError):
                mon.close(linger=0)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.close(linger=0)


def connect_socket(sock: zmq.Socket, endpoint: Endpoint | str) -> None:
    """Connect ``sock`` to the server at ``endpoint`` (IPv6 literals need ``zmq.IPV6``).

    Raises:
        InvalidArgumentError: ZMQ refuses the address (the socket is left to the caller).
    """
    ep = endpoint if isinstance(endpoint, Endpoint) else parse_zmq_url(endpoint)
    if ep.ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(ep.url)
    except zmq.ZMQError as err:
        raise InvalidArgumentError(f"ZMQ cannot connect to {ep.url!r}: {err}") from err
