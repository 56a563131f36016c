"""The driver loop of one fleet job: route, dispatch, collect, retry.

Items are pulled from the input in windows (so a generator input is consumed lazily and
memory stays bounded), routed (:mod:`.routing`), queued per server and sent to the
server's actor, at most ``max_in_flight`` per actor, ``items_per_call`` per Ray call. One
``ray.wait`` over every outstanding reference (run calls, lookup fan-outs, probes of
recovering actors) drives everything from one thread.

Every item is acknowledged by the outcome its actor returns. When an actor is lost
(killed, crashed, node gone), the items of its unanswered calls are queued again for the
same server with ``verify`` set (see :mod:`._engine`) and sent once the actor is back (or
replaced); a retry whose store was refused because the lost attempt's prepared slots
still block those chunks is held back until the server's write TTL has passed.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lmcache_kv_fast.batch import BatchReport
from lmcache_kv_fast.distributed._common import Member, first_line, server_answers
from lmcache_kv_fast.distributed.actor import kv_from_wire, kv_to_wire
from lmcache_kv_fast.distributed.report import FleetProgress, FleetReport
from lmcache_kv_fast.distributed.routing import NEEDS_LOOKUP, Router, pick_server, placement
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.validation import check_salt, normalize_tokens

logger = logging.getLogger(__name__)

#: Items routed per lookup fan-out.
ROUTE_WINDOW = 64
#: Seconds past the write TTL before a deferred retry.
TTL_MARGIN_S = 1.0


@dataclass(eq=False)
class _Item:
    index: int
    tokens: list[int]
    kv: Any = None
    attempts: int = 0
    verify: bool = False
    not_before: float = 0.0
    lost_at: float | None = None
    via_index: bool = False
    rerouted: bool = False


@dataclass(eq=False)
class _Window:
    items: list[_Item]
    created: float = field(default_factory=time.perf_counter)
    hits: dict[int, list[int]] = field(default_factory=dict)
    asked: set[int] = field(default_factory=set)


class Job:
    """One ``rewrite`` / ``store`` / ``retrieve`` over a fleet (driver side)."""

    def __init__(self, fleet: Any, op: str, source: Iterator[tuple[int, Any, Any]],
                 total: int | None, *, fn: Callable[..., Any] | None = None, cache_salt: str = "",
                 route: Any = "lookup", progress: bool = False,
                 on_result: Callable[[int, str | None, str], None] | None = None,
                 report: FleetReport | None = None) -> None:
        if fleet._closed:
            raise KVCacheSDKError("the fleet is closed")
        if fleet.busy:
            raise KVCacheSDKError("the fleet is running another job (one job at a time per Fleet)")
        if report is not None and not isinstance(report, FleetReport):
            raise InvalidArgumentError(f"report must be a FleetReport, got {type(report).__name__}")
        self.fleet, self.op, self._ray = fleet, op, fleet._ray
        self.salt = check_salt(cache_salt)
        self.router = Router(route, fleet.servers)
        self.report = report if report is not None else FleetReport()
        self.on_result = on_result
        self._source, self._exhausted = source, False
        self._want_hashes = self.router.kind == "index" and op in ("rewrite", "store")
        self._fn_meta: dict[str, Any] = {}
        if fn is not None:
            ref = self._ray.put(fn)
            self._fn_meta = {"fn_key": ref.hex(), "fn_box": [ref]}
        n = len(fleet.slots)
        self._pending: list[collections.deque[_Item]] = [collections.deque() for _ in range(n)]
        self._deferred: list[list[_Item]] = [[] for _ in range(n)]
        self._inflight: dict[Any, tuple[Member, int, list[_Item]]] = {}
        self._lookups: dict[Any, tuple[_Window, Member, int]] = {}
        self._windows: list[_Window] = []
        self._relookup: list[_Item] = []
        self._values: collections.deque[tuple[int, Any]] = collections.deque()
        self._first: dict[int, float] = {}
        self._ok: collections.Counter[str] = collections.Counter()
        self._progress = FleetProgress(total, f"fleet {op}", progress, lambda: dict(self._ok))

    # ------------------------------------------------------------------ main loop
    def run(self) -> Iterator[tuple[int, Any]]:
        """Drive the job; yields ``(index, kv | None)`` for ``retrieve`` as items finish."""
        t0 = time.perf_counter()
        self.fleet.busy = True
        try:
            while True:
                self._route_more()
                self.fleet.due_probes()
                self._move_due()
                self._flush_down()
                self._start_windows()
                self._dispatch()
                while self._values:
                    yield self._values.popleft()
                if self._done():
                    break
                self._wait_once()
        except BaseException:
            self._cancel()
            raise
        finally:
            self.fleet.busy = False
            self.report.seconds = time.perf_counter() - t0
            self._progress.close()
        logger.info("fleet %s: %s", self.op, self.report.summary())

    def _done(self) -> bool:
        return (self._exhausted and not self._windows and not self._relookup
                and not self._inflight and not any(self._pending) and not any(self._deferred))

    def _wait_once(self) -> None:
        ray = self._ray
        probes = {s.probe: s for s in self.fleet.slots if s.probe is not None}
        refs = [*self._inflight, *self._lookups, *probes]
        now = time.monotonic()
        dues = [it.not_before for d in self._deferred for it in d]
        dues += [s.probe_due for s in self.fleet.slots if s.state == "recovering" and s.probe is None]
        timeout = max(0.0, min([1.0, *(d - now for d in dues)]))
        if not refs:
            time.sleep(timeout)
            return
        ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            if ref in self._inflight:
                self._run_done(ref)
            elif ref in self._lookups:
                self._lookup_done(ref)
            elif ref in probes:
                self.fleet.probe_done(probes[ref], self.report)

    # ------------------------------------------------------------------ routing
    def _target(self) -> int:
        up = sum(1 for s in self.fleet.slots if s.state != "down") or 1
        return max(ROUTE_WINDOW, 2 * up * self.fleet.max_in_flight * self.fleet.items_per_call)

    def _queued(self) -> int:
        return (sum(len(w.items) for w in self._windows) + sum(map(len, self._pending))
                + sum(len(v[2]) for v in self._inflight.values()))

    def _route_more(self) -> None:
        if self._relookup:
            self._windows.append(_Window(self._relookup))
            self._relookup = []
        while not self._exhausted and self._queued() < self._target():
            need: list[_Item] = []
            for _ in range(ROUTE_WINDOW):
                try:
                    index, toks, kv = next(self._source)
                except StopIteration:
                    self._exhausted = True
                    break
                item = self._admit(index, toks, kv)
                if item is None:
                    continue
                t = time.perf_counter()
                try:
                    d = self.router.direct(item.tokens)
                except Exception as err:
                    self._finish(item, None, "failed", "route", f"{type(err).__name__}: {err}")
                    continue
                finally:
                    self.report.routing_seconds += time.perf_counter() - t
                if d == NEEDS_LOOKUP:
                    need.append(item)
                elif d is None:
                    self._finish(item, None, "missed", "route", "the route function chose no server")
                else:
                    item.via_index = self.router.kind == "index"
                    self._assign(item, d)
            if need:
                self._windows.append(_Window(need))

    def _admit(self, index: int, toks: Any, kv: Any) -> _Item | None:
        stage = "store" if self.op == "store" else "retrieve"
        if self.op == "store":
            if toks is None:
                self._finish(_Item(index, []), None, "failed", "store",
                             f"expected a (kv, tokens) pair, got {type(kv).__name__}")
                return None
            import torch

            if not isinstance(kv, torch.Tensor):
                self._finish(_Item(index, []), None, "failed", "store",
                             f"kv must be a torch.Tensor, got {type(kv).__name__}")
                return None
        try:
            return _Item(index, normalize_tokens(toks), kv)
        except KVCacheSDKError as err:
            self._finish(_Item(index, []), None, "failed", stage, f"{type(err).__name__}: {err}")
            return None

    def _start_windows(self) -> None:
        up = [s for s in self.fleet.slots if s.state == "up"]
        for w in self._windows:
            for slot in up:
                if slot.index in w.hits or slot.index in w.asked:
                    continue
                ref = slot.handle.lookup_many.remote([it.tokens for it in w.items], self.salt)
                self._lookups[ref] = (w, slot, slot.gen)
                w.asked.add(slot.index)
        for w in list(self._windows):
            self._maybe_window_done(w)

    def _lookup_done(self, ref: Any) -> None:
        w, slot, gen = self._lookups.pop(ref)
        try:
            w.hits[slot.index] = self._ray.get(ref)
        except Exception as err:
            if _is_lost(err):
                if self.fleet.lost(slot, gen, err):
                    self.report.actors_lost += 1
                w.asked.discard(slot.index)  # asked again once the actor is back
            else:
                logger.warning("lookups on %s failed: %s", slot.server.name, first_line(err))
                w.hits[slot.index] = [-1] * len(w.items)
        self._maybe_window_done(w)

    def _maybe_window_done(self, w: _Window) -> None:
        slots = self.fleet.slots
        if w not in self._windows or not all(s.index in w.hits or s.state == "down" for s in slots):
            return
        self._windows.remove(w)
        self.report.routing_seconds += time.perf_counter() - w.created
        up = [s.state != "down" for s in slots]
        for k, item in enumerate(w.items):
            hits = [w.hits[s.index][k] if s.index in w.hits else -1 for s in slots]
            best = pick_server(hits)
            if best is not None:
                self._assign(item, best)
                continue
            if self.op == "store":
                home = placement(item.tokens, len(slots), self._chunk(), up)
                if home is not None:
                    self._assign(item, home)
                    continue
            unknown = [slots[i].server.name for i, h in enumerate(hits) if h < 0]
            if unknown:  # it may be cached there: not a miss
                self._finish(item, None, "failed", "route",
                             f"cached on none of the servers that answered; no answer from "
                             f"{', '.join(unknown)}")
            else:
                self._finish(item, None, "missed", "route", "cached on no server")

    def _chunk(self) -> int:
        for s in self.fleet.slots:
            if s.info.get("chunk_size"):
                return int(s.info["chunk_size"])
        return 256

    def _assign(self, item: _Item, i: int) -> None:
        slot = self.fleet.slots[i]
        if slot.state == "down":
            self._finish(item, slot, "failed", "server", f"server is down: {slot.down_reason}")
        else:
            self._pending[i].append(item)

    # ------------------------------------------------------------------ dispatch
    def _move_due(self) -> None:
        now = time.monotonic()
        for i, d in enumerate(self._deferred):
            due = [it for it in d if it.not_before <= now]
            if due:
                self._deferred[i] = [it for it in d if it.not_before > now]
                self._pending[i].extendleft(reversed(due))

    def _flush_down(self) -> None:
        for slot in self.fleet.slots:
            if slot.state != "down":
                continue
            i = slot.index
            for it in [*self._pending[i], *self._deferred[i]]:
                self._finish(it, slot, "failed", "server", f"server is down: {slot.down_reason}")
            self._pending[i].clear()
            self._deferred[i].clear()
            self.report.servers_down[slot.server.name] = slot.down_reason

    def _dispatch(self) -> None:
        ray, fleet = self._ray, self.fleet
        for slot in fleet.slots:
            q = self._pending[slot.index]
            while slot.state == "up" and q and slot.in_flight < fleet.max_in_flight:
                n = min(fleet.items_per_call, fleet.max_in_flight - slot.in_flight, len(q))
                items = [q.popleft() for _ in range(n)]
                meta = {"items": [(it.index, it.tokens) for it in items],
                        "verify": [it.verify for it in items], "salt": self.salt,
                        "want_hashes": self._want_hashes, **self._fn_meta}
                args = [ray.put(kv_to_wire(it.kv)) for it in items] if self.op == "store" else []
                ref = slot.handle.run.remote(self.op, meta, *args)
                for it in items:
                    it.attempts += 1
                self._inflight[ref] = (slot, slot.gen, items)
                slot.in_flight += n
                self._first.setdefault(slot.index, time.perf_counter())
                per = self.report.per_server.setdefault(slot.server.name, BatchReport())
                per.peak_in_flight = max(per.peak_in_flight, slot.in_flight)
                total = sum(len(v[2]) for v in self._inflight.values())
                self.report.peak_in_flight = max(self.report.peak_in_flight, total)

    def _run_done(self, ref: Any) -> None:
        slot, gen, items = self._inflight.pop(ref)
        slot.in_flight -= len(items)
        try:
            outs = self._ray.get(ref)
        except Exception as err:
            if _is_lost(err):
                if self.fleet.lost(slot, gen, err):
                    self.report.actors_lost += 1
                for it in items:
                    self._requeue_lost(slot, it, err)
            else:
                for it in items:
                    self._finish(it, slot, "failed", "actor", first_line(err))
            return
        for it, o in zip(items, outs):
            self._outcome(slot, it, o)

    def _requeue_lost(self, slot: Member, it: _Item, err: BaseException) -> None:
        if it.attempts >= self.fleet.max_attempts:
            self._finish(it, slot, "failed", "actor",
                         f"lost with its actor {it.attempts} times (last: {first_line(err)})")
            return
        it.verify = True
        it.lost_at = slot.lost_at or time.monotonic()
        self.report.retried += 1
        self._pending[slot.index].appendleft(it)

    def _outcome(self, slot: Member, it: _Item, o: Any) -> None:
        now = time.monotonic()
        if (o.status == "failed" and o.stage == "store" and o.refused and it.lost_at is not None
                and self.fleet.wait_for_lost_writes and it.attempts < self.fleet.max_attempts):
            due = it.lost_at + slot.write_ttl + TTL_MARGIN_S
            if due > now:
                logger.info("fleet: item %d on %s waits %.0fs for the lost attempt's store "
                            "slots to expire", it.index, slot.server.name, due - now)
                it.not_before = due
                self._deferred[slot.index].append(it)
                self.report.deferred += 1
                return
        if o.status == "missed" and it.via_index and not it.rerouted:
            it.rerouted, it.via_index = True, False  # the index was stale: ask the servers
            self._relookup.append(it)
            return
        if o.status == "failed" and "ServerTimeoutError" in o.reason and \
                not server_answers(slot.server):
            self.fleet.set_down(slot, f"the server stopped answering ({o.reason[:120]})")
        if o.hashes and self.router.index is not None:
            self.router.index.note_hashes(slot.index, o.hashes)
        self._finish(it, slot, o.status, o.stage, o.reason, o.tokens, o.nbytes, o.stages, o.value)

    def _finish(self, it: _Item, slot: Member | None, status: str, stage: str, reason: str,
                tokens: int = 0, nbytes: int = 0, stages: dict[str, float] | None = None,
                value: Any = None) -> None:
        name = slot.server.name if slot is not None else None
        self.report.add_outcome(name, it.index, status, stage, reason, tokens, nbytes,
                                stages or {}, it.attempts)
        if slot is not None and slot.index in self._first:
            self.report.per_server[name].seconds = time.perf_counter() - self._first[slot.index]  # type: ignore[index]
        if status == "ok" and name is not None:
            self._ok[name] += 1
        self._progress.update()
        if self.op == "retrieve":
            self._values.append((it.index, kv_from_wire(value, copy=True) if value is not None else None))
        if self.on_result is not None:
            try:
                self.on_result(it.index, name, status)
            except Exception:
                logger.exception("on_result callback failed")

    # ------------------------------------------------------------------ interrupt
    def _cancel(self) -> None:
        """Stop feeding; let the calls in flight finish on their actors (nothing left behind)."""
        left = sum(map(len, self._pending)) + sum(map(len, self._deferred))
        left += sum(len(w.items) for w in self._windows) + len(self._relookup)
        if not self._exhausted:
            left += sum(1 for _ in self._source)
        self.report.cancelled += left
        if self._inflight:
            try:
                self._ray.wait(list(self._inflight), num_returns=len(self._inflight), timeout=60.0)
            except BaseException:  # a second interrupt: give up waiting
                logger.warning("fleet: stopped waiting for %d calls in flight", len(self._inflight))


def _is_lost(err: BaseException) -> bool:
    """True for errors that mean the actor (or its worker/node) went away, not an item bug."""
    from ray import exceptions as rx

    lost = (rx.RayActorError, rx.ActorUnschedulableError, rx.WorkerCrashedError,
            rx.NodeDiedError, rx.LocalRayletDiedError, rx.ObjectLostError, rx.OwnerDiedError,
            rx.OutOfMemoryError)
    return isinstance(err, lost)
