"""Export query tensors (and KV) to a real LMCache server the way a query-capturing engine does.

Standalone script run by path with an interpreter that has ``lmcache`` (the main venv or
the engine venv); started by ``testbed.query_export`` (never imports
``lmcache_kv_fast``). ``argv[1]`` is a JSON config::

    {"url": "tcp://127.0.0.1:P", "model": NAME, "num_layers": L, "num_kv_heads": NH,
     "head_size": HS, "num_q_heads": HQ, "dtype": "bfloat16", "block_size": 128,
     "num_blocks": 16, "kv_layout": "NHD" | "MLA", "timeout": 30, "tmp_dir": DIR}

It does what LMCache's own vLLM worker adapter and query capture do
(``lmcache.integration.vllm.vllm_multi_process_adapter``, ``lmcache.sdk.qringbuffer``):
an lmcache-driven transfer context (``LMCacheDrivenTransferContext``) registers a paged
CPU KV cache for ``model`` and a paged query ring (``[num_blocks, block_size, HQ·HS]``
per layer, one group, ``vllm_layout_hints()``) for ``model##query``, over POSIX SHM
(``wrap_kv_caches``). ``store_query`` writes a query tensor into ring blocks and sends
``store_q`` (the server copies the blocks into its L1 as ``model##query`` objects);
``store_kv`` does the same for KV with ``store``. Ops (JSON lines, see ``rpc_child``):
``store_query``, ``store_kv``, ``info``.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
from typing import Any

import rpc_child

logger = logging.getLogger("lmcache_kv_fast.engine_side")

QUERY_SUFFIX = "##query"


class Exporter:
    """The registrations and the store ops."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.ctx: Any = None
        self.kv: dict[str, Any] = {}
        self.q: dict[str, Any] = {}
        self.iid = secrets.randbits(31) + 1
        self.req: Any = None
        self._n = 0

    def start(self) -> dict[str, Any]:
        """Register the KV cache and the query ring."""
        import torch
        import zmq
        from lmcache.integration.vllm.utils import vllm_layout_hints
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
            LMCacheDrivenTransferContext,
        )
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        c = self.cfg
        dtype = getattr(torch, c.get("dtype", "bfloat16"))
        nl, nb, bs = int(c["num_layers"]), int(c.get("num_blocks", 16)), int(c["block_size"])
        nh, hs, hq = int(c["num_kv_heads"]), int(c["head_size"]), int(c["num_q_heads"])
        self.timeout = float(c.get("timeout", 30))
        self.bic = int(c["chunk_size"]) // bs
        self.req = RequestClientFactory.create(c["url"], context=zmq.Context())
        self.ctx = LMCacheDrivenTransferContext(self.iid, self.req)
        if c.get("kv_layout", "NHD") == "MLA":
            self.kv = {f"model.layers.{i}.self_attn": torch.zeros(nb, bs, nh * hs, dtype=dtype)
                       for i in range(nl)}
            hints: dict[str, Any] = {}
        else:
            self.kv = {f"model.layers.{i}.self_attn": torch.zeros(2, nb, bs, nh, hs, dtype=dtype)
                       for i in range(nl)}
            hints = {"kv_layout": "NHD"}
        group = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(nl)),
                                 tokens_per_block=bs)]
        self.ctx.register(self.kv, c["model"], 1, self.bic, self.timeout, layout_hints=hints,
                          engine_group_infos=group)
        self.q = {f"lmcache_q_layer_{i}": torch.zeros(nb, bs, hq * hs, dtype=dtype)
                  for i in range(nl)}
        qgroup = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(nl)),
                                  tokens_per_block=bs, sw_size_tokens=-1)]
        self.ctx.register_q(self.q, c["model"] + QUERY_SUFFIX, 1, self.bic, self.timeout,
                            layout_hints=vllm_layout_hints(), engine_group_infos=qgroup)
        self.nb, self.bs = nb, bs
        return {"instance_id": self.iid}

    def _key(self, name: str, tokens: list[int], end: int, salt: str) -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        self._n += 1
        fields = dict(model_name=name, world_size=1, num_kv_readers=1, worker_id=0, start=0,
                      end=end, request_id=f"qexport-{self.iid}-{self._n}", cache_salt=salt)
        if hasattr(IPCCacheServerKey, "from_token_ids"):  # 0.5.7+: packed token_bytes
            return IPCCacheServerKey.from_token_ids(token_ids=tuple(tokens), **fields)
        return IPCCacheServerKey(token_ids=tuple(tokens), **fields)

    def _blocks(self, tokens: int) -> list[int]:
        n = tokens // self.bs
        if n > self.nb:
            raise ValueError(f"{tokens} tokens need {n} blocks; the ring has {self.nb}")
        # a scattered, non-monotonic block order, like a real ring's
        return [(7 * i + 3) % self.nb for i in range(n)] if self.nb % 7 else list(range(n))[::-1]

    def store_query(self, tokens: list[int], path: str, cache_salt: str = "") -> bool:
        """Store ``[L, T, HQ·HS]`` (from ``path``) as the query of ``tokens[:T]``."""
        import torch

        q = torch.load(path)
        t = q.shape[1]
        blocks = self._blocks(t)
        for li, name in enumerate(self.q):
            for j, b in enumerate(blocks):
                self.q[name][b].copy_(q[li, j * self.bs:(j + 1) * self.bs])
        key = self._key(self.cfg["model"] + QUERY_SUFFIX, tokens, t, cache_salt)
        ev = self.ctx.create_recorded_event()
        fut = self.ctx.submit_q_store(key.request_id, key, self.q, [blocks], ev, self.bic)
        return bool(_ok(fut.result(timeout=self.timeout)))

    def store_kv(self, tokens: list[int], path: str, cache_salt: str = "") -> bool:
        """Store ``[2, L, T, NH·HS]`` (or ``[L, T, D]`` for MLA, from ``path``) as KV."""
        import torch

        kv = torch.load(path)
        mla = self.cfg.get("kv_layout", "NHD") == "MLA"
        t = kv.shape[-2]
        blocks = self._blocks(t)
        for li, name in enumerate(self.kv):
            cache = self.kv[name]
            for j, b in enumerate(blocks):
                sl = slice(j * self.bs, (j + 1) * self.bs)
                if mla:
                    cache[b].copy_(kv[li, sl])
                else:
                    cache[:, b].copy_(kv[:, li, sl].reshape(2, self.bs, *cache.shape[3:]))
        key = self._key(self.cfg["model"], tokens, t, cache_salt)
        ev = self.ctx.create_recorded_event()
        fut = self.ctx.submit_store(key.request_id, key, self.kv, [blocks], ev, self.bic)
        return bool(_ok(fut.result(timeout=self.timeout)))

    def info(self) -> dict[str, Any]:
        """The instance id."""
        return {"instance_id": self.iid}

    def shutdown(self) -> None:
        """Unregister the ring and the KV cache."""
        if self.req is None:
            return
        try:
            self.req.unregister_q_cache(self.iid).result(timeout=self.timeout)
            fut = self.ctx.unregister()
            if fut is not None:
                fut.result(timeout=self.timeout)
        except Exception as err:
            logger.warning("unregister: %r", err)


def _ok(result: Any) -> bool:
    """A store future's result: a bool, or ``(event handle, ok)``."""
    if isinstance(result, tuple):
        return bool(result[-1])
    return bool(result)


def main() -> None:
    """Register, then serve requests."""
    out = rpc_child.take_stdout()
    exp = Exporter(json.loads(sys.argv[1]))
    rpc_child.start_or_fail(out, exp.start)
    rpc_child.serve(out, {"store_query": exp.store_query, "store_kv": exp.store_kv,
                          "info": exp.info}, on_exit=exp.shutdown)


if __name__ == "__main__":
    main()
