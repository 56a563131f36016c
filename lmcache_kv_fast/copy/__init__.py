"""Chunk scatter/gather between KV tensors and server-side chunk regions.

Two backends expose the same function list (``open_segment``, ``scatter``, ``gather``,
``fused_rows``, ``alloc_result``, ``reserve_results``, ``release_results``,
``set_threads``, ``get_threads``, ``cap_call_threads``): ``native`` (the C++ core) and
``torch`` (reference and fallback).
:func:`backend` returns the live one.
"""

from lmcache_kv_fast.copy.base import ChunkGeometry, Region, Segment
from lmcache_kv_fast.copy.select import backend, backend_name, get_backend

__all__ = ["ChunkGeometry", "Region", "Segment", "backend", "backend_name", "get_backend"]
