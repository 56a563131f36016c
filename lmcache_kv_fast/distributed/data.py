"""The Ray Data form: rewrite the token lists of a ``ray.data.Dataset``.

:class:`KVRewriteBatches` is a callable class for ``Dataset.map_batches``: each Ray Data
worker connects its own context to every server in ``__init__`` (contexts cannot be
pickled), and each batch's ``tokens`` column is routed (``"lookup"`` through those
contexts, or a callable) and rewritten on the owning server through a per-server
:class:`~lmcache_kv_fast.distributed._engine.ItemEngine`. The output batch keeps every
input column and adds ``kv_status`` (``ok``/``missed``/``failed``), ``kv_server``,
``kv_stage``, ``kv_reason`` and ``kv_tokens_moved``::

    ds = ray.data.from_items([{"tokens": t} for t in token_lists])
    out = rewrite_dataset(ds, servers, "my-model", drop_tokens, concurrency=2)
    bad = out.filter(lambda r: r["kv_status"] != "ok").take_all()

Ray Data re-runs a batch whose worker died, unseen by this class: every item therefore
runs with ``verify`` (an output chunk found already cached is compared with this
attempt's output; see docs/distributed.md). The workers run wherever Ray Data places
them: copies go over SHM when the worker shares the server's host, else through the
server's data plane for remote clients; for node-local copies at scale use
:func:`lmcache_kv_fast.distributed.rewrite` (one pinned actor per server).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from lmcache_kv_fast.batch import DEFAULT_MAX_IN_FLIGHT
from lmcache_kv_fast.distributed._engine import ItemEngine, Outcome
from lmcache_kv_fast.distributed.routing import NEEDS_LOOKUP, Router, pick_server
from lmcache_kv_fast.distributed.servers import as_servers
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.kvcache import connect
from lmcache_kv_fast.validation import normalize_tokens

logger = logging.getLogger(__name__)

STATUS_COLUMNS = ("kv_status", "kv_server", "kv_stage", "kv_reason", "kv_tokens_moved")


class KVRewriteBatches:
    """``map_batches`` callable class: rewrite each row's ``tokens`` on its server.

    Args:
        servers: :class:`~lmcache_kv_fast.distributed.servers.Server` objects, dicts or
            ``(url, http_url[, node])`` tuples.
        model_name: Model of the KV.
        fn: The edit, as for :func:`lmcache_kv_fast.batch.rewrite`.
        cache_salt: Salt of reads and writes.
        route: ``"lookup"`` or a callable ``route(tokens) -> index | name | None``.
        connect_kwargs: More ``connect`` arguments (``heartbeat`` defaults to False).
        max_in_flight: Items in flight per server in this worker.
        tokens_column: Name of the input column of token lists.
    """

    def __init__(self, servers: Any, model_name: str, fn: Callable[..., Any], *,
                 cache_salt: str = "", route: Any = "lookup",
                 connect_kwargs: dict[str, Any] | None = None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, tokens_column: str = "tokens") -> None:
        if not callable(fn):
            raise InvalidArgumentError(f"fn must be callable, got {type(fn).__name__}")
        self.servers = as_servers(servers)
        self.router = Router(route, self.servers)
        if self.router.kind == "index":
            raise InvalidArgumentError("the Ray Data form routes by 'lookup' or a callable; a "
                                       "KVEventsIndex lives in the driver")
        self.fn, self.salt, self.column = fn, cache_salt, tokens_column
        kw = dict(connect_kwargs or {})
        kw.setdefault("heartbeat", False)
        self._ctxs: list[Any] = []
        self._engines: list[ItemEngine | None] = []
        self._down: dict[int, str] = {}
        for i, s in enumerate(self.servers):
            try:
                ctx = connect(s.url, s.http_url, model_name, **kw)
            except KVCacheSDKError as err:
                logger.warning("Ray Data worker: server %s unusable: %s", s.name, err)
                self._down[i] = f"{type(err).__name__}: {err}"
                self._engines.append(None)
                continue
            self._ctxs.append(ctx)
            self._engines.append(ItemEngine(ctx, max_in_flight=max_in_flight))
        self._fanout = cf.ThreadPoolExecutor(max(1, len(self.servers)),
                                             thread_name_prefix="lmckv-data-route")

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Rewrite one batch (numpy format: ``{column: array}``); returns it with status columns."""
        import numpy as np

        if self.column not in batch:
            raise InvalidArgumentError(f"the batch has no {self.column!r} column (got {sorted(batch)})")
        rows = [_as_list(t) for t in batch[self.column]]
        n = len(rows)
        outs: list[Outcome | None] = [None] * n
        server: list[int | None] = [None] * n
        toks: list[list[int] | None] = [None] * n
        need: list[int] = []
        for k, row in enumerate(rows):
            try:
                toks[k] = normalize_tokens(row)
                d = self.router.direct(toks[k])  # type: ignore[arg-type]
            except Exception as err:
                outs[k] = Outcome(k, "failed", "route", f"{type(err).__name__}: {err}")
                continue
            if d == NEEDS_LOOKUP:
                need.append(k)
            elif d is None:
                outs[k] = Outcome(k, "missed", "route", "the route function chose no server")
            else:
                server[k] = d
        if need:
            hits = self._lookups([toks[k] for k in need])  # type: ignore[misc]
            for j, k in enumerate(need):
                best = pick_server([h[j] for h in hits])
                if best is None:
                    outs[k] = Outcome(k, "missed", "route", "cached on no server")
                else:
                    server[k] = best
        futs: dict[int, cf.Future[Outcome]] = {}
        for k in range(n):
            s = server[k]
            if outs[k] is not None or s is None:
                continue
            eng = self._engines[s]
            if eng is None:
                outs[k] = Outcome(k, "failed", "server", f"server is down: {self._down[s]}")
                continue
            futs[k] = eng.submit("rewrite", k, toks[k], fn=self.fn, cache_salt=self.salt,
                                 verify=True)
        for k, f in futs.items():
            outs[k] = f.result()
        out = dict(batch)
        names = [self.servers[s].name if s is not None and o is not None and o.stage != "route" else ""
                 for s, o in zip(server, outs)]
        out["kv_status"] = np.array([o.status for o in outs], dtype=object)  # type: ignore[union-attr]
        out["kv_server"] = np.array(names, dtype=object)
        out["kv_stage"] = np.array([o.stage for o in outs], dtype=object)  # type: ignore[union-attr]
        out["kv_reason"] = np.array([o.reason for o in outs], dtype=object)  # type: ignore[union-attr]
        out["kv_tokens_moved"] = np.array([o.tokens for o in outs], dtype=np.int64)  # type: ignore[union-attr]
        return out

    def _lookups(self, seqs: list[list[int]]) -> list[list[int]]:
        """``[server][seq]`` cached prefix lengths (-1 where unknown), servers in parallel."""
        futs = [self._fanout.submit(e.lookup_many, seqs, self.salt) if e is not None else None
                for e in self._engines]
        return [f.result() if f is not None else [-1] * len(seqs) for f in futs]

    def close(self) -> None:
        """Stop the engines and close the contexts."""
        for e in self._engines:
            if e is not None:
                e.close()
        self._engines = []
        self._fanout.shutdown(wait=True)
        for c in self._ctxs:
            with contextlib.suppress(Exception):
                c.close()
        self._ctxs = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _as_list(t: Any) -> Any:
    return t.tolist() if hasattr(t, "tolist") else t


def rewrite_dataset(ds: Any, servers: Any, model_name: str, fn: Callable[..., Any], *,
                    cache_salt: str = "", route: Any = "lookup",
                    connect_kwargs: dict[str, Any] | None = None,
                    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, tokens_column: str = "tokens",
                    batch_size: int = 16, concurrency: int = 1, **map_batches_kwargs: Any) -> Any:
    """``ds.map_batches(KVRewriteBatches, ...)`` with the right arguments; returns the dataset.

    Args:
        ds: A ``ray.data.Dataset`` with a ``tokens`` column (lists or arrays of ints).
        servers: The fleet's servers.
        model_name: Model of the KV.
        fn: The edit.
        cache_salt: Salt of reads and writes.
        route: ``"lookup"`` or a callable.
        connect_kwargs: More ``connect`` arguments.
        max_in_flight: Items in flight per server per worker.
        tokens_column: Input column name.
        batch_size: Rows per batch.
        concurrency: Ray Data workers (each connects to every server).
        **map_batches_kwargs: More ``map_batches`` arguments (``num_cpus``, ...).

    Returns:
        The lazy output dataset (input columns plus the status columns).
    """
    kwargs = {"servers": servers, "model_name": model_name, "fn": fn, "cache_salt": cache_salt,
              "route": route, "connect_kwargs": connect_kwargs, "max_in_flight": max_in_flight,
              "tokens_column": tokens_column}
    return ds.map_batches(KVRewriteBatches, fn_constructor_kwargs=kwargs, batch_size=batch_size,
                          batch_format="numpy", concurrency=concurrency, **map_batches_kwargs)
