"""Read hints: copy a retrieved prefix from where it lay last time while the server answers.

The wait for ``prepare_retrieve`` is the one wait of a retrieve with nothing to overlap.
Once the lookup answered, the hit chunks are read-locked: they cannot move, change or be
freed until the retrieve commits. If the session knows where they lay last time (an LRU of
prefixes keyed like :meth:`~lmcache_kv_fast.client.session.Session.same_key`, filled from
``prepare_retrieve`` replies and from stores that wrote every chunk), the retrieve gathers
from those slots chunk by chunk until the reply is in (:meth:`ReadHints.gather`), and keeps
a chunk only when the reply names the slot it was read from (:meth:`ReadHints.reconcile`):
a stale hint never gives a wrong byte, and costs at most the copies made meanwhile. SHM
plane only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.protocol.types import Slot
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall

if TYPE_CHECKING:
    from lmcache_kv_fast.client.session import Session

#: Prefixes whose chunk locations a context remembers for speculative gathers.
SLOT_HINTS_MAX = 256


class ReadHints:
    """Where each shard's chunks lay at the last retrieve / full store of a prefix.

    Keys are ``(*same_key, rank)``; values the slots of the prefix's chunks in order.

    Args:
        session: The session whose SHM pool the slots are in.
        enabled: Use hints (``connect(read_hints=...)``); assignable.
    """

    def __init__(self, session: Session, enabled: bool) -> None:
        self._s = session
        self.enabled = enabled
        self.lru: OrderedDict[tuple[Any, ...], list[Slot]] = OrderedDict()
        self._mutex = threading.Lock()

    def key(self, same_key: tuple[str, int, int]) -> tuple[str, int, int] | None:
        """Key of a prefix's read hints: its ``same_key`` (None: hints not used)."""
        if self._s.shm is None or not self.enabled:
            return None
        return same_key

    def remember(self, key: tuple[Any, ...], slots: list[Slot]) -> None:
        """Record where a prefix's chunks lie (bounded LRU)."""
        with self._mutex:
            self.lru[key] = slots
            self.lru.move_to_end(key)
            while len(self.lru) > SLOT_HINTS_MAX:
                self.lru.popitem(last=False)

    def gather(self, ch: Channel, calls: dict[int, PendingCall], hint_key: tuple[Any, ...],
               ranks: list[int], n: int, out: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, dict[int, tuple[list[Slot], int]]]:
        """Gather from where the chunks lay last time until prepare_retrieve has answered.

        Runs after the lookup locked the ``n`` chunks, so none of them can move, change or
        be freed until the retrieve commits. Chunk by chunk, as long as the shard's reply
        has not arrived (so a stale hint costs at most the copies made while the server
        answered). The caller keeps chunk ``i`` only if the reply names the slot it was
        read from (:meth:`reconcile`): then every byte read belonged to that locked object.
        Otherwise (the prefix was evicted and stored again elsewhere, or the hint key
        collided) it copies the chunk again from the reply's slot, so a stale hint never
        gives a wrong byte. The hint's slots are validated against the mapping like any
        reply's. Returns the destination (allocated when ``out`` is None) and, per shard,
        the hint and how many of its leading chunks were copied.
        """
        with self._mutex:
            hints = {r: self.lru.get((*hint_key, r)) for r in ranks}
            for r in ranks:  # recently used: keep it longest
                if hints[r] is not None:
                    self.lru.move_to_end((*hint_key, r))
        if any(h is None or len(h) != n for h in hints.values()):
            return None, {}
        s = self._s
        dst = out if out is not None else s.alloc_result(n * s.chunk_size)
        early: dict[int, tuple[list[Slot], int]] = {}
        assert s.shm is not None
        for r in ranks:
            slots = hints[r]
            assert slots is not None
            try:
                regions = s.shm.regions(slots, s.geom, s.layout.dtype_str, "hint")
            except KVCacheSDKError:  # the pool changed: copy after the reply instead
                continue
            k = 0
            while k < n and not ch.ready(calls[r]):
                s.copy(s.backend.gather, dst, [k], [regions[k]], s.shard_cols[r])
                k += 1
            early[r] = (slots, k)
        return dst, early

    def reconcile(self, hint_key: tuple[Any, ...], r: int, slots: list[Slot],
                  early: dict[int, tuple[list[Slot], int]], n: int
                  ) -> tuple[list[int] | None, int, int]:
        """Check shard ``r``'s early reads against the slots its reply names.

        A chunk read early is right iff the reply names the slot it was read from: the
        lookup's lock kept that object there since. Remembers the reply's slots when they
        differ from the hint.

        Returns:
            ``(todo, kept, redone)``: the chunks still to gather from the reply's slots
            (None: every chunk was read early and the reply names exactly those slots),
            the chunks kept and the chunks read early in vain.
        """
        hint, k = early.get(r, ([], 0))
        ok_early = [i for i in range(min(k, len(slots))) if slots[i] == hint[i]]
        if len(ok_early) == n == len(slots):
            return None, n, k - n  # all read while the reply was on its way
        if slots != hint:
            self.remember((*hint_key, r), slots)
        done = set(ok_early)
        return [i for i in range(n) if i not in done], len(ok_early), k - len(ok_early)
