"""The per-server actor: one context to its server, one :class:`ItemEngine` over it.

:class:`ServerWorker` is a plain class; :class:`~lmcache_kv_fast.distributed.fleet.Fleet`
turns it into a threaded Ray actor pinned to the server's node (node affinity), so every
copy goes through that node's shared memory. Several ``run`` calls are served at once
(the driver bounds the items in flight per actor); they all feed the one engine, whose
buffers stay warm across calls.

Contexts cannot be pickled: each actor connects its own, with ``heartbeat=False`` — a
registration that never pinged is reaped only after the server's registration grace
(3600 s by default), which outlives the write TTL (600 s) of any store slot a killed actor
left prepared, so the server never admits such a half-written slot as data (see
docs/distributed.md, "Faults").
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lmcache_kv_fast.distributed._engine import ItemEngine, Outcome
from lmcache_kv_fast.kvcache import connect

logger = logging.getLogger(__name__)


def kv_to_wire(kv: torch.Tensor) -> tuple[Any, str, tuple[int, ...]]:
    """A KV tensor as ``(uint8 numpy array, dtype name, shape)``: Ray moves it zero-copy."""
    t = kv.contiguous()
    return (t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."),
            tuple(t.shape))


def kv_from_wire(wire: tuple[Any, str, tuple[int, ...]], *, copy: bool) -> torch.Tensor:
    """Rebuild a tensor from :func:`kv_to_wire` (``copy=False``: a read-only view)."""
    arr, dtype, shape = wire
    with warnings.catch_warnings():  # the object store hands out read-only buffers
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr.copy() if copy else arr)
    return t.view(getattr(torch, dtype)).view(shape)


class ServerWorker:
    """One server's worker (made a Ray actor by the fleet).

    Args:
        url: The server's ZMQ URL.
        http_url: Its HTTP URL.
        model_name: Model of the job.
        connect_kwargs: More ``connect`` arguments (``layout``, ``timeout``, ...);
            ``heartbeat`` defaults to False (see the module docstring).
        engine_kwargs: :class:`ItemEngine` arguments (``max_in_flight``, ``workers``).
    """

    def __init__(self, url: str, http_url: str, model_name: str,
                 connect_kwargs: dict[str, Any] | None = None,
                 engine_kwargs: dict[str, Any] | None = None) -> None:
        kw = dict(connect_kwargs or {})
        kw.setdefault("heartbeat", False)
        self.ctx = connect(url, http_url, model_name, **kw)
        self.engine = ItemEngine(self.ctx, **(engine_kwargs or {}))
        self._fns: dict[str, Callable[..., Any]] = {}

    def info(self) -> dict[str, Any]:
        """Who this actor is: ids, data plane, node, and the server's store-slot TTL."""
        node = ""
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except Exception:  # not running under Ray (Ray Data worker tests, plain use)
            node = ""
        write_ttl = 600.0
        try:
            from lmcache_kv_fast.transport.http import HttpInfoClient

            st = HttpInfoClient(self.ctx.http_url, 5.0, self.ctx.api_key).status()
            write_ttl = float(st["storage_manager"]["l1_manager"].get("write_ttl_seconds", 600))
        except Exception as err:
            logger.debug("cannot read the server's write TTL: %s", err)
        return {
            "instance_id": self.ctx.instance_id,
            "transport": self.ctx.transport,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": node,
            "chunk_size": self.ctx.chunk_size,
            "write_ttl_seconds": write_ttl,
        }

    def lookup_many(self, token_lists: list[Any], cache_salt: str = "") -> list[int]:
        """Cached prefix length of each sequence on this server (-1: the lookup failed)."""
        return self.engine.lookup_many(token_lists, cache_salt)

    def run(self, op: str, meta: dict[str, Any], *kvs: Any) -> list[Outcome]:
        """Run a few items; returns their outcomes (item errors never raise).

        Args:
            op: ``rewrite`` | ``store`` | ``retrieve``.
            meta: ``items`` (``[(index, tokens)]``), ``verify`` (bools), ``fn_key`` and
                ``fn_box`` (``[ObjectRef]`` of the edit, fetched once per actor),
                ``salt``, ``want_hashes``.
            *kvs: ``store``: one wire KV (:func:`kv_to_wire`) per item, resolved by Ray.
        """
        items = meta["items"]
        fn = self._fn(meta.get("fn_key"), meta.get("fn_box")) if op == "rewrite" else None
        futs = []
        for j, (index, toks) in enumerate(items):
            payload: Any = toks
            if op == "store":
                payload = (kv_from_wire(kvs[j], copy=False), toks)
            futs.append(self.engine.submit(op, index, payload, fn=fn, cache_salt=meta.get("salt", ""),
                                           verify=bool(meta["verify"][j]),
                                           want_hashes=bool(meta.get("want_hashes"))))
        outs = [f.result() for f in futs]
        if op == "retrieve":
            for o in outs:
                if o.value is not None:
                    o.value = kv_to_wire(o.value)
        return outs

    def _fn(self, key: str | None, box: list[Any] | None) -> Callable[..., Any]:
        if key is None or box is None:
            raise ValueError("rewrite needs fn_key and fn_box")
        fn = self._fns.get(key)
        if fn is None:
            import ray

            fn = ray.get(box[0])
            if len(self._fns) > 16:
                self._fns.clear()
            self._fns[key] = fn
        return fn

    def close(self) -> bool:
        """Finish running items, close the context (unregisters cleanly)."""
        self.engine.close()
        self.ctx.close()
        return True
