"""Lookup: how many leading chunks of a prefix are cached, read-locking them.

``lookup`` → ``wait_prefetch_status`` (polled in slices so one wait never blocks the
server's normal pool for long) answers the number of leading hit chunks, which stay
read-locked until a retrieve commits them or ``free_lookup_locks`` releases them (docs/protocol.md §3.3,
§11 #14). :func:`lookup_release` is the lock-free variant a public ``lookup`` and the
store's checks use.

A lookup that times out may still run on the server and lock its hit prefix: the channel
is retired with an obligation (``client/late.py``) that consumes the late result, frees
the locks and ends the session.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from lmcache_kv_fast.client.late import Obligation, Settler
from lmcache_kv_fast.errors import ProtocolError, ServerTimeoutError
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import CacheKey
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall

if TYPE_CHECKING:
    from lmcache_kv_fast.client.session import Session

#: Seconds one ``wait_prefetch_status`` may block the server's normal pool.
PREFETCH_WAIT_SLICE_S = 0.1
#: Obligations outlive the server-side TTL of what they hold by this much (seconds).
LATE_MARGIN_S = 10.0


def cached_tokens(s: Session, toks: list[int], salt: str, rc: dict[str, Any] | None,
                  t0: float) -> int:
    """The public lookup of validated whole-chunk ``toks``: cached prefix in tokens."""
    with s.op(rc, name="lookup", t0=t0) as ch:
        return lookup_release(s, ch, toks, salt) * s.chunk_size


def lookup_chunks(s: Session, ch: Channel, tokens: list[int], rid: str, salt: str) -> int:
    """Run lookup + wait; return the number of leading hit chunks (read-locked)."""
    n_chunks = len(tokens) // s.chunk_size
    key = s.key(tokens, 0, n_chunks * s.chunk_size, rid, salt, None)
    c_lookup = ch.send(Op.LOOKUP, [key, s.world_size])
    deadline = time.monotonic() + s.timeout
    c_wait = None
    if s.fifo_normal_pool:  # FIFO pool: the wait runs after the lookup
        c_wait = ch.send(Op.WAIT_PREFETCH_STATUS, [rid, PREFETCH_WAIT_SLICE_S])
    try:
        ch.wait(c_lookup)
    except ServerTimeoutError:
        settle_late_lookup(s, ch, key, rid, c_lookup, c_wait)
        raise
    except BaseException:
        if c_wait is not None:
            ch.discard(c_wait)
        raise
    result = None
    while result is None:
        if c_wait is None:
            c_wait = ch.send(Op.WAIT_PREFETCH_STATUS, [rid, PREFETCH_WAIT_SLICE_S])
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            settle_late_lookup(s, ch, key, rid, None, c_wait)
            raise ServerTimeoutError(
                f"lookup of {len(tokens)} tokens on {s.url} not finished after "
                f"{s.timeout:g}s"
            )
        try:
            result = ch.wait(c_wait, int | None, remaining + PREFETCH_WAIT_SLICE_S)
        except ServerTimeoutError:
            settle_late_lookup(s, ch, key, rid, None, c_wait)
            raise
        c_wait = None
    if not 0 <= result <= n_chunks:
        free_locks(s, ch, key)
        raise ProtocolError(
            f"wait_prefetch_status answered {result} hit chunks for a {n_chunks}-chunk lookup"
        )
    return int(result)


def settle_late_lookup(s: Session, ch: Channel, key: CacheKey, rid: str,
                       c_lookup: PendingCall | None, c_wait: PendingCall | None) -> None:
    """Retire ``ch``: finish a timed-out lookup when its late replies come.

    Once the lookup ran and a ``wait_prefetch_status`` returned its (locked) hit count,
    ``free_lookup_locks`` releases exactly what it locked; then the session ends. The
    caller must not end the session itself.
    """
    ob = Obligation(f"lookup {rid}: free its read locks and end its session",
                    time.monotonic() + s.read_ttl_s + LATE_MARGIN_S)
    ob.settler = _late_lookup(s, ch, key, rid, c_lookup, c_wait)
    s.late.adopt(ch, ob)


def _late_lookup(s: Session, ch: Channel, key: CacheKey, rid: str,
                 c_lookup: PendingCall | None, c_wait: PendingCall | None) -> Settler:
    if c_lookup is not None:
        try:
            yield c_lookup, None  # the job exists once the lookup answered
        except ProtocolError:
            pass
    result = None
    while result is None:
        if c_wait is None:
            c_wait = ch.send(Op.WAIT_PREFETCH_STATUS, [rid, PREFETCH_WAIT_SLICE_S])
        try:
            result = yield c_wait, int | None
        except ProtocolError:
            result = 0
        c_wait = None
    if result:  # releases exactly what the session recorded as locked; before the end
        try:
            yield ch.send(Op.FREE_LOOKUP_LOCKS, [key, s.world_size]), None
        except ProtocolError:
            pass
    # (A miss locked nothing: no free, which a restarted server that does not know the
    # model would not even answer, having created the session it raises in.)
    s.end_session(ch, rid)


def free_locks(s: Session, ch: Channel, key: CacheKey,
               worker_id: int | None = None) -> None:
    """Release a lookup's read locks (call before end_session)."""
    k = msgspec.structs.replace(key, worker_id=worker_id)
    s.wait_quiet(ch, ch.send(Op.FREE_LOOKUP_LOCKS, [k, s.world_size]))


def lookup_release(s: Session, ch: Channel, toks: list[int], salt: str) -> int:
    """Lookup, then release every lock and the session it took; return the hit chunks."""
    rid = s.rid("l")
    hit = 0
    try:
        hit = lookup_chunks(s, ch, toks, rid, salt)
    finally:
        if ch.retired:  # timed out: the late-reply settler frees and ends
            pass
        elif hit:
            key = s.key(toks, 0, hit * s.chunk_size, rid, salt, None)
            c_free = ch.send(Op.FREE_LOOKUP_LOCKS, [key, s.world_size])
            if s.fifo_normal_pool:  # one FIFO thread: the end runs after the free
                s.end_session(ch, rid)
                s.wait_quiet(ch, c_free)
            else:
                s.wait_quiet(ch, c_free)
                s.end_session(ch, rid)
        else:
            s.end_session(ch, rid)
    return hit
