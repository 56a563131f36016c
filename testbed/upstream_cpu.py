"""What upstream 0.5.6's ``lmcache.sdk`` needs around it to run against a CPU vLLM engine.

Used for reference runs of upstream's stream and batch code on the real engine (the sdk
engine tests, bench W6); it imports ``lmcache`` only when used:

1. ``register_caches`` reads only lmcache-driven (GPU-style) registrations
   (``/status`` ``cache_context_meta``); a CPU engine registers engine-driven, so a
   vLLM-like registration is added whose one-plane object is the engine's rows
   (``MLA`` layout of width ``NH·2·HS``).
2. ``retrieve`` then returns the engine's rows ``[L, T, NH·2·HS]``; upstream's stream code
   reads ``shape[2]`` as the token count and the user's edit expects per-token K/V, so
   rows are converted to ``[2, L, T, NH·HS]`` (``CpuEngineKV.to_tokens``).
3. ``store`` converts back (``to_raw``); 0.5.6's ``ContiguousTransferWrapper.store``
   slices 4-D tensors and cannot store one-plane objects, so the rows go through
   upstream's own engine-driven context with one-plane slices (its code otherwise).

Run a program under it with ``python -m testbed.upstream_cpu URL MODEL
KERNEL program.py args...`` or use :func:`upstream_on_cpu_engine` in-process.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from lmcache_kv_fast.layout import CpuEngineKV, KVLayout
from lmcache_kv_fast.testing.register import VllmLikeRegistration, register_vllm_layout

__all__ = ["cpu_engine_kv", "register_rows_layout", "store_rows", "upstream_on_cpu_engine"]


def register_rows_layout(url: str, model_name: str, cpu: CpuEngineKV) -> VllmLikeRegistration:
    """A vLLM-like registration whose one-plane object is the engine's rows (item 1 above).

    Upstream's ``connect`` reads it; unregister it once connected (nobody else should see it).
    """
    raw = cpu.raw_layout
    return register_vllm_layout(url, model_name, num_layers=raw.num_layers, num_kv_heads=1,
                                head_size=raw.head_dim, dtype=raw.dtype_str,
                                block_size=raw.block_size, layout="MLA")


def store_rows(ctx: Any, rows: Any, tokens: Sequence[int], cache_salt: str = "",
               request_configs: dict[str, object] | None = None) -> bool:
    """Upstream 0.5.6's ``LMCacheSDKContext.store`` of one-plane rows ``[L, T, W]``.

    Its own ``store`` cannot write a one-plane object over SHM: it takes ``[X, L, T, D]``
    and ``ContiguousTransferWrapper.store`` copies the 4-D slice ``kv[:, :, a:b, :]`` into
    the 3-D ``[L, C, W]`` slot (RuntimeError: "output with shape [L, C, W] doesn't match the
    broadcast shape [1, L, C, W]"). This is the same flow (its key, its engine-driven
    context's ``prepare_store`` / ``commit_store``, ``end_session``) with the slot copy
    taking the one plane. Whole chunks of ``tokens`` are stored.
    """
    c = ctx.chunk_size
    t = len(tokens) // c * c
    rows = rows[:, :t].contiguous()
    rid = f"store-{uuid.uuid4().hex}"
    key = ctx._create_key(list(tokens[:t]), 0, t, rid, cache_salt, request_configs, 0)
    inner = ctx.transfer_ctx._context
    try:
        res = inner.prepare_store(key, ctx.instance_id)
        if res is None:  # pickle plane
            chunks = [rows[:, i * c:(i + 1) * c].contiguous() for i in range(t // c)]
        else:
            for slot, ci in zip(*res, strict=True):
                slot.copy_(rows[:, ci * c:(ci + 1) * c])
            chunks = []
        return bool(inner.commit_store(key, ctx.instance_id, chunks))
    finally:
        ctx.end_session(rid)


@contextlib.contextmanager
def upstream_on_cpu_engine(url: str, model_name: str, cpu: CpuEngineKV) -> Iterator[None]:
    """Make ``lmcache.sdk`` work on a CPU engine's model for the duration of the block."""
    from lmcache.sdk.context import LMCacheSDKContext

    raw = cpu.raw_layout
    reg = register_rows_layout(url, model_name, cpu)
    orig_retrieve, orig_store = LMCacheSDKContext.retrieve, LMCacheSDKContext.store

    def retrieve(self, tokens, cache_salt="", request_configs=None):
        rows = orig_retrieve(self, tokens, cache_salt, request_configs)
        return None if rows is None else cpu.to_tokens(rows.reshape(raw.num_layers, -1,
                                                                    raw.head_dim))

    def store(self, kv, tokens, cache_salt="", request_configs=None):
        t = len(tokens) // self.chunk_size * self.chunk_size
        return store_rows(self, cpu.to_raw(kv[:, :, :t].contiguous()), tokens[:t], cache_salt,
                          request_configs)

    LMCacheSDKContext.retrieve, LMCacheSDKContext.store = retrieve, store
    try:
        yield
    finally:
        LMCacheSDKContext.retrieve, LMCacheSDKContext.store = orig_retrieve, orig_store
        reg.unregister()


def cpu_engine_kv(model_dir: str, kernel: str, block_size: int = 128) -> CpuEngineKV:
    """The engine's KV geometry and kernel order."""
    return CpuEngineKV.from_token_layout(KVLayout.from_hf_config(model_dir, block_size=block_size),
                                         kernel)


def main() -> None:
    """``upstream_cpu URL MODEL KERNEL PROGRAM ARGS...``: run PROGRAM under the harness."""
    url, model, kernel, program, *args = sys.argv[1:]
    with upstream_on_cpu_engine(url, model, cpu_engine_kv(model, kernel)):
        sys.argv = [program, *args]
        runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
