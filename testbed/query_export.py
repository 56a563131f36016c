"""Query tensors on a real LMCache server, produced the way a query-capturing engine does.

The vLLM in the engine venv cannot export query tensors (upstream needs a vLLM patch,
``examples/token_dropping/vllm-export-intermediate-tensors.diff``), so
:class:`QueryExporter` runs LMCache's own server-facing classes in a child process
(``engine_side/query_exporter.py``): an lmcache-driven transfer context registers a
paged KV cache and a paged query ring for the model, and stores query tensors with
``store_q`` (and KV with ``store``), exactly as LMCache's vLLM adapter does. The server
must run with the query module and ``--supported-transfer-mode auto``: ``--enable
transfer_query`` up to 0.5.6 (:data:`QUERY_SERVER_ARGS`), the ``qstore`` server module from
0.5.7 on (``--server-module``); :func:`query_server_kwargs` picks the right one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from testbed.engine_proc import ChildOwner, EngineChild

__all__ = ["QUERY_SERVER_ARGS", "QueryExporter", "query_server_kwargs"]

#: Extra server flags for the query module up to 0.5.6 (``LMCacheServer(extra_args=...)``;
#: the server fixture already passes ``--supported-transfer-mode auto``). 0.5.7 removed
#: ``--enable`` (its parser then fails with "ambiguous option").
QUERY_SERVER_ARGS = ("--enable", "transfer_query")


def query_server_kwargs(version: str | None) -> dict[str, Any]:
    """``LMCacheServer`` arguments that load the query module on a server of ``version``.

    ``--enable transfer_query`` up to 0.5.6 (and for None, the main venv's 0.5.6); the
    ``qstore`` plugin (``--server-module``, :data:`~lmcache_kv_fast.testing.server.QSTORE_MODULE`)
    from 0.5.7 on.
    """
    from lmcache_kv_fast.protocol.ops import parse_version
    from lmcache_kv_fast.testing.server import QSTORE_MODULE

    parsed = parse_version(version) if version is not None else None
    if parsed is not None and parsed >= (0, 5, 7):
        return {"server_modules": [QSTORE_MODULE]}
    return {"extra_args": list(QUERY_SERVER_ARGS)}


class QueryExporter(ChildOwner):
    """A child process that registers a model's KV cache and query ring and stores into them.

    Args:
        url: ZMQ URL of the server.
        model: Model name (queries go to ``model##query``).
        num_layers: Layers.
        num_kv_heads: KV heads (the KV cache's geometry).
        head_size: Head size.
        num_q_heads: Query heads (the query width is ``num_q_heads * head_size``).
        chunk_size: The server's chunk size.
        dtype: Dtype name.
        block_size: Tokens per block (of the KV cache and the ring).
        num_blocks: Blocks of the ring and of the KV cache (enough for the longest store).
        kv_layout: ``"NHD"`` (two planes) or ``"MLA"`` (one plane of
            ``num_kv_heads * head_size``, the shape a CPU engine's rows have).
        python: Interpreter with ``lmcache`` (default: this one).
    """

    def __init__(self, url: str, model: str, *, num_layers: int, num_kv_heads: int,
                 head_size: int, num_q_heads: int, chunk_size: int, dtype: str = "bfloat16",
                 block_size: int = 128, num_blocks: int = 16, kv_layout: str = "NHD",
                 python: str | Path | None = None, timeout: float = 30.0) -> None:
        self.model = model
        self.num_layers, self.num_q_heads, self.head_size = num_layers, num_q_heads, head_size
        self.dtype = getattr(torch, dtype)
        self._child = EngineChild("query_exporter.py", {
            "url": url, "model": model, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
            "head_size": head_size, "num_q_heads": num_q_heads, "chunk_size": chunk_size,
            "dtype": dtype, "block_size": block_size, "num_blocks": num_blocks,
            "kv_layout": kv_layout, "timeout": timeout,
        }, name="query-exporter", python=python or sys.executable, start_timeout=120.0)
        self.instance_id = 0

    @property
    def query_width(self) -> int:
        """``num_q_heads * head_size``."""
        return self.num_q_heads * self.head_size

    def _ready(self, info: dict[str, Any]) -> None:
        # the child registered the KV cache and the query ring; it unregisters on stop
        self.instance_id = int(info.get("instance_id", 0))

    def random_query(self, tokens: int, seed: int) -> torch.Tensor:
        """A ``[L, tokens, HQ·HS]`` query tensor of the model's dtype."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.num_layers, tokens, self.query_width, generator=g).to(self.dtype)

    def _send(self, op: str, tokens: Sequence[int], t: torch.Tensor, salt: str) -> bool:
        return bool(self._child.call_send(op, t, timeout=120.0, tokens=[int(x) for x in tokens],
                                          cache_salt=salt))

    def store_query(self, tokens: Sequence[int], q: torch.Tensor, cache_salt: str = "") -> bool:
        """Store ``q`` (``[L, T, HQ·HS]``, T a multiple of the chunk size) for ``tokens``."""
        return self._send("store_query", tokens, q, cache_salt)

    def store_kv(self, tokens: Sequence[int], kv: Any, cache_salt: str = "") -> bool:
        """Store KV (``[2, L, T, NH·HS]``, or ``[L, T, D]`` for MLA) for ``tokens``."""
        return self._send("store_kv", tokens, kv, cache_salt)
