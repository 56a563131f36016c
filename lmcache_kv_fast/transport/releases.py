"""Deferred releases: ``commit_retrieve`` sent without waiting for its reply.

A retrieve's data is in the caller's tensor once the gather finished; what is left is to
drop the read locks (``commit_retrieve``) and then the session (``end_session``). Waiting
for those replies would add a round trip plus the server's processing to every retrieve,
so they are sent on one shared DEALER socket and their replies are collected later:

* ``end_session`` goes out only after every commit of its request was acknowledged: the
  commits run on the server's affinity pool, the end on its normal pool, and a commit that
  ran after the end would re-create the session.
* The server keys pending transfers by ``(instance_id, key)`` ignoring the request id
  (docs/protocol.md §3.4): an identical operation of the same context may only prepare once the earlier
  commit was processed. :meth:`DeferredReleases.wait_key` waits for that acknowledgement
  (the context calls it under its per-key lock; commits of other keys never wait).
* Everything that must see the locks gone (``clear``, ``close``) settles first.

The socket is used by several threads, always under ``_lock`` and only for sends,
non-blocking receives or polls of at most ``_POLL_MS``, so nobody holds the lock while
waiting for anything else. The context's background thread collects acknowledgements a
few milliseconds after they arrive, so sessions end promptly also when the caller goes
idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from lmcache_kv_fast.errors import ServerTimeoutError
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.transport.zmq_client import Channel, ZmqClient

if TYPE_CHECKING:
    from lmcache_kv_fast.transport.grpc_client import GrpcClient

logger = logging.getLogger(__name__)

_POLL_MS = 1  # longest a waiter holds the lock while polling the socket


class DeferredReleases:
    """The deferred ``commit_retrieve`` → ``end_session`` chains of one context.

    Args:
        client: The context's ZMQ client (the shared socket is one of its channels).
        on_pending: Called (outside the lock) when releases become pending, to wake the
            thread that collects them.
    """

    def __init__(self, client: ZmqClient | GrpcClient, on_pending: Callable[[], None] | None = None) -> None:
        self._client = client
        self._on_pending = on_pending
        self._lock = threading.Lock()
        self._ch: Channel | None = None
        self._keys: dict[Hashable, int] = {}  # key -> commits not acknowledged yet
        self._rids: dict[str, int] = {}  # request id -> commits not acknowledged yet
        self._uids: dict[bytes, tuple[Hashable, str]] = {}  # commit uid -> (key, rid)

    # -- state (read without the lock: a stale answer only delays or adds one check) --
    def pending(self) -> bool:
        """Whether any commit or end_session still awaits its acknowledgement."""
        ch = self._ch
        return bool(self._uids) or (ch is not None and ch.unacked > 0)

    def busy(self, key: Hashable) -> bool:
        """Whether a commit of ``key`` awaits its acknowledgement."""
        return key in self._keys

    # -- sending ---------------------------------------------------------------------
    def commit(self, payloads: Sequence[list[Any]], rid: str, key: Hashable) -> None:
        """Send ``commit_retrieve`` for each payload; end ``rid``'s session after them.

        Args:
            payloads: ``[key, instance_id]`` of every shard read.
            rid: The request (session) id.
            key: Same-key token of the operation (see :meth:`wait_key`).

        Raises:
            ContextClosedError: The client is closed (nothing was sent then).
        """
        with self._lock:
            ch = self._channel()
            self._collect_locked(ch, 0)
            was_pending = bool(self._uids) or ch.unacked > 0
            for p in payloads:
                uid = ch.fire(Op.COMMIT_RETRIEVE, p, on_ack=self._acked)
                self._uids[uid] = (key, rid)
                self._keys[key] = self._keys.get(key, 0) + 1
                self._rids[rid] = self._rids.get(rid, 0) + 1
        if self._on_pending is not None and not was_pending:
            self._on_pending()

    def _channel(self) -> Channel:
        if self._ch is None:
            self._ch = self._client.new_channel()
        return self._ch

    def _acked(self, uid: bytes) -> None:
        """A commit's reply arrived (called under the lock, from Channel._drain).

        The end_session is fired *before* the commit leaves ``_uids``, so :meth:`pending`
        (read without the lock by the collecting thread) never reads False in between:
        that thread sleeps long once it sees nothing pending.
        """
        entry = self._uids.get(uid)
        if entry is None:
            return
        key, rid = entry
        left_rid = self._rids.get(rid, 0) - 1
        if left_rid <= 0:
            assert self._ch is not None
            self._ch.fire(Op.END_SESSION, [rid])  # its own reply is collected like the rest
            self._rids.pop(rid, None)
        else:
            self._rids[rid] = left_rid
        left = self._keys.get(key, 0) - 1
        if left > 0:
            self._keys[key] = left
        else:
            self._keys.pop(key, None)
        del self._uids[uid]

    # -- receiving -------------------------------------------------------------------
    def _collect_locked(self, ch: Channel, timeout_ms: int) -> None:
        if ch.peer_lost():  # the server went away or restarted: those requests are lost
            self._forget(ch)
            return
        ch.collect(timeout_ms)

    def _forget(self, ch: Channel) -> None:
        ch.forget_unacked()
        self._uids.clear()
        self._keys.clear()
        self._rids.clear()

    def collect(self) -> None:
        """Consume the acknowledgements that arrived, if nobody else holds the socket."""
        if self._ch is None or not self._lock.acquire(blocking=False):
            return
        try:
            self._collect_locked(self._ch, 0)
        except zmq.ZMQError as err:  # closed under us: close() is running
            logger.debug("collecting release acknowledgements: %s", err)
        finally:
            self._lock.release()

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._ch is None or done():
                    return True
                self._collect_locked(self._ch, _POLL_MS)
                if done():
                    return True
            if time.monotonic() >= deadline:
                return False

    def wait_key(self, key: Hashable, timeout: float) -> None:
        """Wait until no commit of ``key`` awaits its acknowledgement.

        Raises:
            ServerTimeoutError: None arrived within ``timeout`` seconds.
        """
        if not self._wait(lambda: key not in self._keys, timeout):
            raise ServerTimeoutError(
                f"commit_retrieve to {self._client.url} of an identical earlier retrieve was "
                f"not acknowledged within {timeout:g}s"
            )

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every commit and end_session; True when all came."""
        ch = self._ch
        return self._wait(lambda: not self._uids and (ch is None or ch.unacked == 0), timeout)
