"""A fleet of LMCache servers on Ray: one actor per server, and the batch calls over it.

:class:`Fleet` starts one :class:`~lmcache_kv_fast.distributed.actor.ServerWorker` actor
per server, pinned to the server's node (hard node affinity), and keeps it alive: an actor
that dies is restarted by Ray (``max_restarts``); one that cannot come back (restarts used
up, node gone) is replaced by a new actor (anywhere, when the node is gone) as long as the
server still answers, else the server is given up and its items fail naming it. The batch
calls (:meth:`Fleet.rewrite`, :meth:`Fleet.store_many`, :meth:`Fleet.retrieve_many`) run
through :mod:`lmcache_kv_fast.distributed._scheduler`. The module-level functions build a
fleet for one call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lmcache_kv_fast.batch import DEFAULT_MAX_IN_FLIGHT
from lmcache_kv_fast.distributed._common import (
    PROBE_RETRY_S,
    Member,
    first_line,
    server_answers,
    unregister_reader,
)
from lmcache_kv_fast.distributed._raycompat import require_ray
from lmcache_kv_fast.distributed.actor import ServerWorker
from lmcache_kv_fast.distributed.report import FleetReport
from lmcache_kv_fast.distributed.servers import as_servers, resolve_node
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError

logger = logging.getLogger(__name__)

class Fleet:
    """Actors on a fleet of LMCache servers for one model; reusable across jobs.

    Use it as a context manager (or call :meth:`close`): closing lets every actor finish
    its items and unregister its context, so nothing is left on the servers.

    Args:
        servers: :class:`Server` objects, dicts or ``(url, http_url[, node])`` tuples.
        model_name: Model of every job.
        connect_kwargs: More :func:`lmcache_kv_fast.connect` arguments for every actor
            (``layout``, ``timeout``, ``world_size``, ...).
        remote_connect_kwargs: Overrides for actors not on their server's node (a server on
            no Ray node, or a replacement after the node was lost), which cannot map an SHM
            pool: pass the pickle plane's option once ``connect`` has one (docs/distributed.md).
        max_in_flight: Items in flight per actor (memory bound per node).
        items_per_call: Items per Ray call (1: every item acknowledged on its own).
        workers: Engine worker threads per actor (None: as ``batch``).
        max_restarts / max_replacements / max_attempts: Ray restarts per actor; new actors
            per server after permanent losses; times one item may be sent to an actor.
        wait_for_lost_writes: Retry an item whose store was refused after its first attempt
            died mid-store once the server's write TTL has passed (the dead attempt's
            prepared slots block those chunks until then); False reports it.
        recover_timeout / startup_timeout: Seconds an actor may take to come back (else its
            server is given up) / to start (else its server is down).
        actor_options: More ``ray.remote`` options (e.g. ``num_cpus``); ray_init:
            ``ray.init`` arguments when Ray is not initialized yet.

    Raises:
        MissingExtraError: Ray is not installed.
        KVCacheSDKError: No server of the fleet could be reached.
    """

    def __init__(self, servers: Any, model_name: str, *, connect_kwargs: dict[str, Any] | None = None,
                 remote_connect_kwargs: dict[str, Any] | None = None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, items_per_call: int = 1,
                 workers: int | None = None, max_restarts: int = 2, max_replacements: int = 1,
                 max_attempts: int = 3, wait_for_lost_writes: bool = True,
                 recover_timeout: float = 120.0, startup_timeout: float = 120.0,
                 actor_options: dict[str, Any] | None = None,
                 ray_init: dict[str, Any] | None = None) -> None:
        self._ray = ray = require_ray()
        for name, v in (("max_in_flight", max_in_flight), ("items_per_call", items_per_call),
                        ("max_attempts", max_attempts)):
            if type(v) is not int or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidArgumentError(f"model_name must be a non-empty str, got {model_name!r}")
        self.servers = as_servers(servers)
        self.model_name = model_name
        self.connect_kwargs = dict(connect_kwargs or {})
        self.remote_connect_kwargs = {**self.connect_kwargs, **(remote_connect_kwargs or {})}
        self.busy = False  # one job at a time
        self.max_in_flight = max_in_flight
        self.items_per_call = items_per_call
        self.max_attempts = max_attempts
        self.max_restarts = max_restarts
        self.max_replacements = max_replacements
        self.wait_for_lost_writes = wait_for_lost_writes
        self.recover_timeout = recover_timeout
        self._engine_kwargs = {"max_in_flight": max_in_flight, "workers": workers}
        self._actor_options = dict(actor_options or {})
        self._closed = False
        if not ray.is_initialized():
            ray.init(**(ray_init or {}))
        self._remote = ray.remote(ServerWorker)
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = ray.nodes()
        self.slots = [Member(i, s, resolve_node(s, nodes, driver_node)) for i, s in enumerate(self.servers)]
        try:
            self._start_all(startup_timeout)
        except BaseException:
            self.close()
            raise
        if all(s.state == "down" for s in self.slots):
            reasons = "; ".join(f"{s.server.name}: {s.down_reason}" for s in self.slots)
            self.close()
            raise KVCacheSDKError(f"no server of the fleet could be used: {reasons}")

    # ------------------------------------------------------------------ actors
    def _new_actor(self, slot: Member, *, soft: bool = False) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts: dict[str, Any] = {
            "max_restarts": self.max_restarts, "max_task_retries": 0,
            "max_concurrency": self.max_in_flight + 4, "num_cpus": 0,
        }
        if slot.node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(slot.node, soft=soft)
        opts.update(self._actor_options)
        s = slot.server
        ck = self.connect_kwargs if slot.node is not None and not soft else self.remote_connect_kwargs
        return self._remote.options(**opts).remote(s.url, s.http_url, self.model_name, ck,
                                                   self._engine_kwargs)

    def _start_all(self, timeout: float) -> None:
        ray = self._ray
        for slot in self.slots:
            slot.handle = self._new_actor(slot)
            slot.probe = slot.handle.info.remote()
        deadline = time.monotonic() + timeout
        waiting = {slot.probe: slot for slot in self.slots}
        while waiting:
            ready, _ = ray.wait(list(waiting), num_returns=1,
                                timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for slot in waiting.values():
                    self.set_down(slot, f"its actor did not start within {timeout:g}s")
                return
            for ref in ready:
                slot = waiting.pop(ref)
                slot.probe = None
                try:
                    slot.info = ray.get(ref)
                    slot.state = "up"
                except Exception as err:
                    self.set_down(slot, f"its actor could not start: {first_line(err)}")

    def set_down(self, slot: Member, reason: str) -> None:
        """Give a server up (its items fail with ``reason``)."""
        if slot.state != "down":
            logger.warning("fleet: giving up server %s: %s", slot.server.name, reason)
        slot.state, slot.down_reason, slot.probe = "down", reason, None

    def lost(self, slot: Member, gen: int, err: BaseException) -> bool:
        """Note that ``slot``'s actor (generation ``gen``) was lost; True if this is news."""
        if gen != slot.gen or slot.state in ("recovering", "down"):
            return False
        slot.gen += 1
        slot.state = "recovering"
        slot.lost_at = time.monotonic()
        iid = slot.info.get("instance_id")
        if iid is not None:
            slot.lost_instances.append(iid)
        logger.warning("fleet: lost the actor of %s (%s); recovering", slot.server.name,
                       first_line(err))
        slot.probe, slot.probe_due = None, time.monotonic()
        return True

    def due_probes(self) -> None:
        """Start the probes of recovering actors that are due."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.state != "recovering" or slot.probe is not None or slot.probe_due > now:
                continue
            if now - slot.lost_at > self.recover_timeout:
                self.set_down(slot, f"its actor did not come back within {self.recover_timeout:g}s")
                continue
            slot.probe = slot.handle.info.remote()

    def probe_done(self, slot: Member, report: FleetReport) -> None:
        """Handle the answer of ``slot.probe`` (up again, still restarting, or dead)."""
        ray = self._ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, ActorUnschedulableError

        ref, slot.probe = slot.probe, None
        try:
            slot.info = ray.get(ref)
            slot.state = "up"
            logger.info("fleet: actor of %s is back (instance %s)", slot.server.name,
                        slot.info.get("instance_id"))
            return
        except ActorUnavailableError:  # Ray is restarting it
            slot.probe_due = time.monotonic() + PROBE_RETRY_S
            return
        except (ActorDiedError, ActorUnschedulableError) as err:
            why = first_line(err)
        except Exception as err:
            why = first_line(err)
        self._replace(slot, why, report)

    def _replace(self, slot: Member, why: str, report: FleetReport) -> None:
        alive = server_answers(slot.server)
        if not alive:
            self.set_down(slot, f"the server does not answer (and its actor is gone: {why})")
            return
        if slot.replacements >= self.max_replacements:
            self.set_down(slot, f"its actor is gone and {slot.replacements} replacement(s) "
                                f"were used up: {why}")
            return
        node_alive = slot.node is None or any(
            n.get("Alive") and n["NodeID"] == slot.node for n in self._ray.nodes())
        slot.replacements += 1
        report.actors_replaced += 1
        logger.warning("fleet: starting a new actor for %s (%s)%s", slot.server.name, why,
                       "" if node_alive else "; its node is gone: it runs on another node")
        old = slot.handle
        slot.handle = self._new_actor(slot, soft=not node_alive)
        try:
            self._ray.kill(old, no_restart=True)
        except Exception:
            pass
        slot.probe = slot.handle.info.remote()

    def actor(self, server: int | str) -> Any:
        """The current actor handle of a server (by index or name)."""
        from lmcache_kv_fast.distributed.routing import server_index

        i = server_index(server, self.servers)
        assert i is not None
        return self.slots[i].handle

    # ------------------------------------------------------------------ jobs
    def rewrite(self, token_lists: Iterable[Sequence[int]], fn: Callable[..., Any], *,
                cache_salt: str = "", route: Any = "lookup", progress: bool = True,
                on_result: Callable[[int, str | None, str], None] | None = None) -> FleetReport:
        """Rewrite every sequence on the server that holds it (see module ``rewrite``)."""
        if not callable(fn):
            raise InvalidArgumentError(f"fn must be callable, got {type(fn).__name__}")
        from lmcache_kv_fast.distributed._scheduler import Job

        job = Job(self, "rewrite", _enumerate_tokens(token_lists), _len(token_lists), fn=fn,
                  cache_salt=cache_salt, route=route, progress=progress, on_result=on_result)
        for _ in job.run():
            pass
        return job.report

    def store_many(self, items: Iterable[tuple[torch.Tensor, Sequence[int]]], *,
                   cache_salt: str = "", route: Any = "lookup", progress: bool = False,
                   on_result: Callable[[int, str | None, str], None] | None = None) -> FleetReport:
        """Store ``(kv, tokens)`` pairs, each on its prefix's server (else a hashed home)."""
        from lmcache_kv_fast.distributed._scheduler import Job

        job = Job(self, "store", _enumerate_pairs(items), _len(items), cache_salt=cache_salt,
                  route=route, progress=progress, on_result=on_result)
        for _ in job.run():
            pass
        return job.report

    def retrieve_many(self, token_lists: Iterable[Sequence[int]], cache_salt: str = "", *,
                      route: Any = "lookup", report: FleetReport | None = None,
                      progress: bool = False) -> Iterator[tuple[int, torch.Tensor | None]]:
        """Retrieve sequences from their servers; yields ``(index, kv | None)`` as they finish."""
        from lmcache_kv_fast.distributed._scheduler import Job

        job = Job(self, "retrieve", _enumerate_tokens(token_lists), _len(token_lists),
                  cache_salt=cache_salt, route=route, progress=progress, report=report)
        yield from job.run()

    def lookup(self, token_lists: Sequence[Sequence[int]], cache_salt: str = "") -> list[list[int]]:
        """Cached prefix (tokens) of each sequence on each server: ``[seq][server]``, -1 = unknown."""
        ray = self._ray
        toks = [list(t) for t in token_lists]
        refs = {s.index: s.handle.lookup_many.remote(toks, cache_salt)
                for s in self.slots if s.state == "up"}
        per: dict[int, list[int]] = {}
        for i, ref in refs.items():
            try:
                per[i] = ray.get(ref)
            except Exception as err:
                logger.warning("lookup on %s failed: %s", self.servers[i].name, first_line(err))
        return [[per[i][k] if i in per else -1 for i in range(len(self.slots))]
                for k in range(len(toks))]

    # ------------------------------------------------------------------ close
    def close(self, timeout: float = 60.0) -> None:
        """Let every actor finish its items and close its context, then end the actors."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        refs = {}
        for slot in self.slots:
            if slot.handle is not None and slot.state != "down":
                try:
                    refs[slot.handle.close.remote()] = slot
                except Exception:
                    pass
        closed = set()
        if refs:
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
            for ref in done:
                try:
                    ray.get(ref)
                    closed.add(refs[ref].index)
                except Exception as err:
                    logger.debug("closing the actor of %s: %s", refs[ref].server.name, err)
        self._unregister_dead_readers(closed)
        for slot in self.slots:
            if slot.handle is not None:
                try:
                    ray.kill(slot.handle, no_restart=True)
                except Exception:
                    pass
                slot.handle = None

    def _unregister_dead_readers(self, closed: set[int]) -> None:
        """Unregister, from here, the readers of actors that died without closing their context.

        A lost actor (replaced, or dead before ``close``) leaves its registration until the
        server reaps it; its writer is left to that reaper (docs/distributed.md).
        """
        for slot in self.slots:
            stale = set(slot.lost_instances)
            iid = slot.info.get("instance_id")
            if iid is not None:
                (stale.discard if slot.index in closed else stale.add)(iid)
            for dead in sorted(stale):
                unregister_reader(slot.server, dead, self.connect_kwargs.get("api_key"), timeout=2.0)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- helpers
def _len(x: Any) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None


def _enumerate_tokens(token_lists: Iterable[Any]) -> Iterator[tuple[int, Any, Any]]:
    for i, t in enumerate(token_lists):
        yield i, t, None


def _enumerate_pairs(items: Iterable[Any]) -> Iterator[tuple[int, Any, Any]]:
    for i, it in enumerate(items):
        try:
            kv, toks = it
        except (TypeError, ValueError):
            yield i, None, it  # reported as a bad item by the scheduler
            continue
        yield i, toks, kv


# ---------------------------------------------------------------------- one-call forms
def rewrite(servers: Any, model_name: str, token_lists: Iterable[Sequence[int]],
            fn: Callable[..., Any], *, cache_salt: str = "", route: Any = "lookup",
            progress: bool = True, on_result: Callable[[int, str | None, str], None] | None = None,
            **fleet_kwargs: Any) -> FleetReport:
    """Rewrite sequences across a fleet: each on the server that holds it, next to its data.

    Every sequence is routed (``route``: ``"lookup"``, a callable or a
    :class:`~lmcache_kv_fast.distributed.events_index.KVEventsIndex`), then retrieved on
    its server's node, edited with ``fn(kv, tokens) -> (new_kv, new_tokens)`` (``alloc``
    supported, as in :func:`lmcache_kv_fast.batch.rewrite`) and stored there under
    ``new_tokens``. ``fn`` is shipped to the actors (it must be picklable by Ray) and
    should be deterministic: retries after a lost actor rely on it (docs/distributed.md).

    Args:
        servers: :class:`Server` objects, dicts or ``(url, http_url[, node])`` tuples.
        model_name: Model of the KV.
        token_lists: Sequences to rewrite.
        fn: The edit.
        cache_salt: Salt of reads and writes.
        route: Routing strategy (see :mod:`lmcache_kv_fast.distributed.routing`).
        progress: A progress bar over the fleet (tqdm if installed, else log lines).
        on_result: Called as ``on_result(index, server_name, status)`` per finished item.
        **fleet_kwargs: :class:`Fleet` arguments (``max_in_flight``, ``connect_kwargs``...).

    Returns:
        The merged :class:`FleetReport` (per-server reports in ``per_server``).
    """
    with Fleet(servers, model_name, **fleet_kwargs) as fleet:
        return fleet.rewrite(token_lists, fn, cache_salt=cache_salt, route=route,
                             progress=progress, on_result=on_result)


def store_many(servers: Any, model_name: str, items: Iterable[tuple[torch.Tensor, Sequence[int]]],
               *, cache_salt: str = "", route: Any = "lookup", progress: bool = False,
               **fleet_kwargs: Any) -> FleetReport:
    """Store ``(kv, tokens)`` pairs across a fleet (see :meth:`Fleet.store_many`)."""
    with Fleet(servers, model_name, **fleet_kwargs) as fleet:
        return fleet.store_many(items, cache_salt=cache_salt, route=route, progress=progress)


def retrieve_many(servers: Any, model_name: str, token_lists: Iterable[Sequence[int]],
                  cache_salt: str = "", *, route: Any = "lookup", report: FleetReport | None = None,
                  progress: bool = False, **fleet_kwargs: Any
                  ) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Retrieve sequences across a fleet; yields ``(index, kv | None)`` in completion order."""
    with Fleet(servers, model_name, **fleet_kwargs) as fleet:
        yield from fleet.retrieve_many(token_lists, cache_salt, route=route, report=report,
                                       progress=progress)
