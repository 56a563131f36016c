"""Per-token K/V for a CPU vLLM engine's model, until the core context does it itself.

A CPU engine registers engine-driven, so ``/status`` carries no layout for its model and
its objects are the engine's fused rows (``docs/engine-kv-layout.md``). The core's
``connect()`` is gaining the resolution and the conversion (``model_config=`` etc.);
until the installed core has them, the sdk context resolves the geometry here
(:func:`~lmcache_kv_fast.layout.resolve_engine_layout`), connects with the raw layout and
converts rows <-> per-token ``[2, L, T, NH·HS]`` around its reads and writes
(:class:`~lmcache_kv_fast.layout.CpuEngineKV`). With a core that resolves engines
itself, :func:`cpu_engine_for` returns None and nothing here runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from lmcache_kv_fast.context import LMCacheKVCacheContext
from lmcache_kv_fast.layout import CpuEngineKV, find_model_entries, resolve_engine_layout
from lmcache_kv_fast.transport.http import HttpInfoClient

__all__ = ["core_resolves_engines", "cpu_engine_for"]


def core_resolves_engines() -> bool:
    """Whether the core context finds a CPU engine's geometry by itself."""
    return "model_config" in inspect.signature(LMCacheKVCacheContext.__init__).parameters


def cpu_engine_for(http_url: str, model_name: str, timeout: float, options: dict[str, Any]
                   ) -> tuple[CpuEngineKV, dict[str, Any]] | None:
    """The converter and connect options for a CPU engine's model, or None.

    None when the core does it itself, the caller gave a layout, the model has a
    lmcache-driven (GPU vLLM) registration, or no engine-driven one.
    """
    if core_resolves_engines() or options.get("layout") is not None:
        return None
    status = HttpInfoClient(http_url.rstrip("/"), timeout).status()
    if find_model_entries(status, model_name):
        return None
    meta = status.get("non_cuda_context_meta") or {}
    if not any(isinstance(e, dict) and e.get("model_name") == model_name for e in meta.values()):
        return None
    res = resolve_engine_layout(status, model_name, world_size=options.get("world_size"))
    if res.cpu is None:
        return None
    return res.cpu, {**options, "layout": res.layout, "world_size": res.world_size}
