"""What every control-plane client shares: per-thread channels and a close that waits.

:class:`ChannelBase` is the bookkeeping every channel keeps (its owner thread, fired calls,
wait time); the transports add how requests travel.

``ZmqClient`` and ``GrpcClient`` differ in how a channel talks to the server, not in how
channels are handed out: one per calling thread (created on first use), unbound ones for
the late-reply settler and the deferred releases, ``active()`` sections that ``close()``
waits for, and ``settle()`` of the fired calls. :class:`ChannelRegistry` is that part once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from lmcache_kv_fast.errors import ContextClosedError
from lmcache_kv_fast.protocol.ops import Op

C = TypeVar("C")


class ChannelBase:
    """State and calls a channel has whatever its transport (a base class)."""

    def __init__(self, client: Any, bound: bool) -> None:
        self._client = client
        #: Fired calls (see ``fire()``) whose acknowledgement has not arrived yet.
        self._unacked: dict[bytes, Any] = {}
        #: Callbacks of fired calls, run (on the draining thread) when their reply arrives.
        self._on_ack: dict[bytes, Callable[[bytes], None]] = {}
        #: Thread that owns this channel (0: not bound to a thread, see ``new_channel()``).
        self.owner = threading.get_ident() if bound else 0
        #: A call timed out and nothing was received since (a shortened next wait).
        self.unresponsive = False
        #: Seconds spent blocked in ``wait`` and the number of waits (for OpTiming).
        self.wait_s = 0.0
        self.waits = 0
        #: Handed to the late-reply settler (``retire``): its old thread must not use it.
        self.retired = False

    @property
    def client(self) -> Any:
        """The client this channel belongs to."""
        return self._client

    @property
    def unacked(self) -> int:
        """Fired calls whose reply has not been consumed yet."""
        return len(self._unacked)

    def send(self, op: Op, payloads: Sequence[Any] = (), *, raw: Sequence[Any] = ()) -> Any:
        """Send one request; return its handle (each transport's own)."""
        raise NotImplementedError

    def wait(self, call: Any, resp_type: Any = None, timeout: float | None = None) -> Any:
        """Wait for the reply of ``call`` and decode it (each transport's own)."""
        raise NotImplementedError

    def call(self, op: Op, payloads: Sequence[Any] = (), resp_type: Any = None,
             timeout: float | None = None, *, raw: Sequence[Any] = ()) -> Any:
        """Send one request and wait for its reply (see :meth:`send`, :meth:`wait`)."""
        return self.wait(self.send(op, payloads, raw=raw), resp_type, timeout)


class ChannelRegistry(Generic[C]):
    """Per-thread channels of one client; subclasses make them (:meth:`_make_channel`)."""

    url: str

    def __init__(self) -> None:
        self.closed = False
        self.closing = False
        self._active = 0
        self._idle = threading.Condition()
        self._local = threading.local()
        self._channels: list[C] = []
        self._lock = threading.Lock()

    # -- what a transport provides ------------------------------------------------------
    def _make_channel(self, bound: bool) -> C:
        """A new channel (bound: to the calling thread)."""
        raise NotImplementedError

    def _keep(self, ch: C, alive: set[int]) -> bool:
        """Whether a registered channel stays listed (``alive``: idents of live threads)."""
        owner = getattr(ch, "owner", 0)
        return not owner or owner in alive

    # -- shared -------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Mark channel use in progress; ``close`` waits for it."""
        with self._idle:
            if self.closing:
                raise ContextClosedError(f"the SDK context for {self.url} is closed")
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                if self._active == 0:
                    self._idle.notify_all()

    def check_open(self) -> None:
        """Raise ContextClosedError when closed."""
        if self.closing:
            raise ContextClosedError(f"the SDK context for {self.url} is closed")

    def channel(self) -> C:
        """Return the calling thread's channel, creating it on first use."""
        ch = getattr(self._local, "channel", None)
        if ch is None:
            self.check_open()
            ch = self._make_channel(True)
            self._local.channel = ch
            with self._lock:
                alive = {t.ident for t in threading.enumerate()}
                self._channels = [c for c in self._channels if self._keep(c, alive)]
                self._channels.append(ch)
        return ch

    def retire(self, ch: C) -> None:
        """Unbind ``ch`` from its thread, which gets a fresh channel on its next call.

        ``ch`` keeps its in-flight calls and their late replies; its new user (the
        late-reply settler, ``client/late.py``) takes it over after a lock handoff. It is
        closed with the client, or earlier by :meth:`drop`.
        """
        if getattr(self._local, "channel", None) is ch:
            self._local.channel = None
        ch.owner = 0  # type: ignore[attr-defined]
        ch.retired = True  # type: ignore[attr-defined]

    def drop(self, ch: C) -> None:
        """Close a channel not bound to a thread and forget it."""
        with self._lock:
            if ch in self._channels:
                self._channels.remove(ch)
        ch.close()  # type: ignore[attr-defined]

    def new_channel(self) -> C:
        """Return a fresh channel not bound to a thread (its user serialises access)."""
        self.check_open()
        ch = self._make_channel(False)
        with self._lock:
            self._channels.append(ch)
        return ch

    def call(self, op: Op, payloads: Sequence[Any] = (), resp_type: Any = None,
             timeout: float | None = None, *, raw: Sequence[Any] = ()) -> Any:
        """Call ``op`` on the calling thread's channel."""
        return self.channel().call(op, payloads, resp_type, timeout, raw=raw)  # type: ignore[attr-defined]

    def settle(self, timeout: float) -> bool:
        """Let every channel collect the acknowledgements of its fired calls.

        Only when no call is running on any channel.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            channels = list(self._channels)
        ok = True
        for ch in channels:
            ok &= ch.settle(max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]
        return ok

    def _close_channels(self) -> bool:
        """Start closing: wait for active sections, close every channel; False if closed."""
        with self._idle:
            if self.closing:
                return False
            self.closing = True
            # Waiters notice `closing` within one poll slice; channels close after that.
            self._idle.wait_for(lambda: self._active == 0, timeout=5.0)
        self.closed = True
        with self._lock:
            channels, self._channels = self._channels, []
        for ch in channels:
            ch.close()  # type: ignore[attr-defined]
        return True
