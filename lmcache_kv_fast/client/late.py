"""Late replies: finish on the server what a timed-out operation left there.

The server has no deadlines and no abort RPC (docs/protocol.md §2.7, §3.3): a request the client gave
up on still runs when the server gets to it -- after a freeze (SIGSTOP), a long GC pause,
a flood -- and takes what it takes: a store reservation (``prepare_store``), read locks
(``lookup``, ``prepare_retrieve``), a session. Dropping its late reply leaks them; worse,
an unfilled reservation is admitted as data when its instance is unregistered or reaped.

So when an operation times out with such requests outstanding, the thread's channel
(DEALER socket) is *retired* (``ZmqClient.retire``) and handed, with an
:class:`Obligation`, to this module; the calling thread gets a fresh channel for its next
call. An obligation is a generator written like the flow it finishes: it yields
``(call, reply_type)`` for each reply it needs and receives the decoded reply (or the
``ProtocolError`` thrown into it), sends what must follow (``commit_store`` of a late
reservation filled from a snapshot of the caller's KV, ``commit_retrieve``,
``free_lookup_locks``, ``end_session``) and returns when the server holds nothing more of
that operation. The context's background thread drives every obligation
(:meth:`LateReplies.drive`, one poll over the retired channels: a ``zmq.Poller`` over
their sockets, or the gRPC client's completion condition) while any is
pending; ``close()`` drives them for a bounded time before it unregisters
(:meth:`LateReplies.settle`).

An obligation gives up at its deadline (the server-side TTL of what it holds, plus a
margin: after it the resources expired anyway) or when the server is known to have
forgotten this client (restart, reap). A store obligation that never committed *pins the
writer registration*: it is never unregistered, so its reservation is never admitted
(docs/protocol.md §3.2); the server reaps it after its registration grace, when the reservation's write
TTL has expired and ``finish_write`` refuses it (``docs/server-defects.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Hashable
from typing import Any

import zmq

from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall

logger = logging.getLogger(__name__)

#: What an obligation yields: a call whose reply it needs, and the reply's msgspec type.
Step = tuple[PendingCall, Any]
Settler = Generator[Step, Any, None]

#: close() drives pending obligations at most this long (also bounded by the timeout).
SETTLE_LATE_S = 5.0
#: Clones of the KV of timed-out stores a context may hold at once (to fill their late
#: reservations); beyond it a late reservation is left unfilled (and never admitted).
SNAPSHOT_BUDGET_BYTES = 1 << 30
#: The background thread polls retired sockets in slices of this many seconds.
LATE_POLL_S = 0.02
#: Once the server forgot this client, obligations get this long to finish.
VOID_GRACE_S = 5.0


class Obligation:
    """The work one timed-out operation still owes the server.

    Set :attr:`settler` (a generator that may read and write the obligation) before
    handing it to :meth:`LateReplies.adopt`.

    Args:
        what: Human description (logged when it is given up).
        deadline: ``time.monotonic()`` after which it is given up.
        key: The operation's ``same_key`` (identical operations wait for it), or None.
        pins_writer: While pending, the writer registration must not be unregistered
            (a ``prepare_store`` of it may hold a reservation).
        snapshot_bytes: Bytes of the KV clone it holds (returned to the budget at the end).
    """

    settler: Settler

    def __init__(self, what: str, deadline: float, *, key: Hashable | None = None,
                 pins_writer: bool = False, snapshot_bytes: int = 0) -> None:
        self.what = what
        self.deadline = deadline
        self.key = key
        self.pins_writer = pins_writer
        self.snapshot_bytes = snapshot_bytes
        #: The call whose reply the settler waits for, and its type (None: finished).
        self.waiting: Step | None = None
        #: Lower bound of the arrival time of the last reply handed to the settler.
        self.reply_at = 0.0
        #: When its socket was last found without the awaited reply (create the obligation
        #: right when the operation's wait gave up).
        self.polled_at = time.monotonic()
        #: Set by the settler when a reservation may stay unfilled on the server for good.
        self.abandoned_reservation = False


class LateReplies:
    """The obligations of one session, and the retired channels they run on.

    Args:
        wake: Wakes the thread that drives obligations (the session's background thread)
            and starts it when needed.
    """

    def __init__(self, wake: Any) -> None:
        self._wake = wake
        self._lock = threading.Condition()
        self._items: list[tuple[Channel, Obligation]] = []
        self._keys: dict[Hashable, int] = {}
        self._snapshot_bytes = 0
        #: Reservations given up unfilled (see :meth:`pins_writer`).
        self.abandoned = 0
        self._drive_lock = threading.RLock()  # one driver at a time (reentrant: GC)

    # -- state (read without the lock: a stale answer only delays by one iteration) ----
    def pending(self) -> bool:
        """Whether any obligation is pending."""
        return bool(self._items)

    def busy(self, key: Hashable) -> bool:
        """Whether an obligation of ``key`` is pending."""
        return bool(self._keys) and key in self._keys

    def pins_writer(self) -> bool:
        """Whether a late or abandoned reservation forbids unregistering the writer."""
        return self.abandoned > 0 or any(ob.pins_writer for _, ob in list(self._items))

    def describe(self) -> list[str]:
        """What every pending obligation holds (for logs)."""
        return [ob.what for _, ob in list(self._items)]

    # -- snapshots -------------------------------------------------------------------
    def take_snapshot_budget(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of the snapshot budget; False when it would be exceeded."""
        with self._lock:
            if self._snapshot_bytes + nbytes > SNAPSHOT_BUDGET_BYTES:
                return False
            self._snapshot_bytes += nbytes
            return True

    # -- handing over ----------------------------------------------------------------
    def adopt(self, ch: Channel, ob: Obligation) -> None:
        """Retire ``ch`` (from its owning thread) and let ``ob`` finish on it.

        The settler's first step runs here, on the owning thread; from then on only the
        driver touches ``ch`` (the lock below is the hand-off).
        """
        ch.client.retire(ch)
        self._step(ch, ob, None, first=True)
        with self._lock:
            if ob.waiting is None and not ch.unacked:
                self._finish_locked(ch, ob, drop_now=True)
                return
            self._items.append((ch, ob))
            if ob.key is not None:
                self._keys[ob.key] = self._keys.get(ob.key, 0) + 1
        logger.info("left to finish in the background: %s", ob.what)
        self._wake()

    # -- driving ---------------------------------------------------------------------
    def drive(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for late replies and run the obligations they unblock."""
        if not self._drive_lock.acquire(timeout=max(timeout_s, 0.0)):
            return
        try:
            with self._lock:
                items = list(self._items)
            if not items:
                return
            try:  # every retired channel is one of the session's client's
                ready = items[0][0].client.poll([ch for ch, _ in items], timeout_s)
            except zmq.ZMQError as err:  # closed under us: close() runs
                logger.debug("polling late replies: %s", err)
                return
            now = time.monotonic()
            for ch, ob in items:
                # A reply found now arrived after the previous look at this socket (a
                # poll slice ago, or before a stall of this process).
                arrived_after = ob.polled_at
                ob.polled_at = now
                self._advance(ch, ob, ch in ready, now, arrived_after)
        finally:
            self._drive_lock.release()

    def settle(self, timeout_s: float) -> bool:
        """Drive until no obligation is pending or ``timeout_s`` passed; True when none is."""
        deadline = time.monotonic() + timeout_s
        while self._items:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.drive(min(left, 0.05))
        for what in self.describe():
            logger.warning("still pending at close(): %s", what)
        return not self._items

    def void(self, reason: str) -> None:
        """The server forgot this client (restart, reap): give every obligation a short while.

        Requests queued on a retired socket while the server was down are delivered to the
        restarted server when the socket reconnects; a lookup among them runs there and
        takes a session and locks. So obligations are not dropped at once: those whose
        replies come within ``VOID_GRACE_S`` still release what they took.
        """
        deadline = time.monotonic() + VOID_GRACE_S
        with self._lock:
            for _, ob in self._items:
                if ob.deadline > deadline:
                    logger.info("%s: %s; giving it %gs", ob.what, reason, VOID_GRACE_S)
                    ob.deadline = deadline
                ob.pins_writer = False  # that server holds no reservation of ours

    def close(self) -> None:
        """Give up every pending obligation (after :meth:`settle`, before the sockets close)."""
        with self._drive_lock:
            with self._lock:
                items, self._items = self._items, []
                self._keys.clear()
            for ch, ob in items:
                self._give_up(ch, ob, "the context closed")

    # -- internals -------------------------------------------------------------------
    def _advance(self, ch: Channel, ob: Obligation, readable: bool, now: float,
                 arrived_after: float) -> None:
        try:
            if ch.peer_lost():
                # The server went away (killed, restarted): what it held is gone with it.
                self._remove(ch, ob)
                logger.info("dropping %s: the connection to the server dropped", ob.what)
                ob.settler.close()
                ch.client.drop(ch)
                return
            if readable:
                ch.collect(0)
            while ob.waiting is not None and ch.ready(ob.waiting[0]):
                ob.reply_at = arrived_after
                self._step(ch, ob, ob.waiting)
        except (zmq.ZMQError, KVCacheSDKError) as err:
            self._remove(ch, ob)
            self._give_up(ch, ob, f"its socket failed: {err}")
            return
        if ob.waiting is None and not ch.unacked:
            self._remove(ch, ob)
            with self._lock:
                self._finish_locked(ch, ob, drop_now=True)
        elif now > ob.deadline:
            self._remove(ch, ob)
            self._give_up(ch, ob, "its deadline passed (the server-side resources expired)")

    def _step(self, ch: Channel, ob: Obligation, waiting: Step | None, *,
              first: bool = False) -> None:
        """Feed the settler the reply it waits for; record what it waits for next."""
        try:
            if first:
                nxt = next(ob.settler)
            else:
                assert waiting is not None
                call, tp = waiting
                try:
                    value = ch.wait(call, tp, 0.0)
                except ProtocolError as err:
                    nxt = ob.settler.throw(err)
                else:
                    nxt = ob.settler.send(value)
            ch.expect(nxt[0])
            ob.waiting = nxt
        except StopIteration:
            ob.waiting = None

    def _remove(self, ch: Channel, ob: Obligation) -> None:
        with self._lock:
            try:
                self._items.remove((ch, ob))
            except ValueError:
                return
            if ob.key is not None:
                left = self._keys.get(ob.key, 0) - 1
                if left > 0:
                    self._keys[ob.key] = left
                else:
                    self._keys.pop(ob.key, None)
            self._lock.notify_all()

    def _finish_locked(self, ch: Channel, ob: Obligation, *, drop_now: bool) -> None:
        self._snapshot_bytes -= ob.snapshot_bytes
        ob.snapshot_bytes = 0
        if ob.abandoned_reservation:
            self.abandoned += 1
        if drop_now:
            logger.info("finished: %s", ob.what)
            ch.client.drop(ch)

    def _give_up(self, ch: Channel, ob: Obligation, why: str) -> None:
        logger.warning("giving up %s: %s", ob.what, why)
        if ob.pins_writer:  # a reservation may exist that nobody will fill
            ob.abandoned_reservation = True
        ob.settler.close()
        with self._lock:
            self._finish_locked(ch, ob, drop_now=False)
        ch.client.drop(ch)

    def wait_key(self, key: Hashable, timeout: float) -> bool:
        """Wait until no obligation of ``key`` is pending; False after ``timeout``."""
        with self._lock:
            return self._lock.wait_for(lambda: key not in self._keys, timeout)
