"""Per-token stores of a CPU engine's KV into a fresh server pool, and a warmed pool.

A fresh server's SHM pool is a sparse file: a per-token store (converted chunk by chunk
into the engine's rows) into never-allocated slots goes through a staging chunk and the
copy core's cold-page path (no page faults, no zeroing), a store into allocated slots
converts straight into them. Either way the bytes are the engine's rows of the K/V given.
``LMCacheServer.warm_pool`` allocates the holes only: stored objects keep their bytes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import unique_model_name

pytest.importorskip("lmcache_kv_fast._native")

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import _native
from lmcache_kv_fast.layout import CpuEngineKV
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven

CONFIG = {  # a Llama config.json: 2 layers, 2 KV heads x 64, bfloat16 (128 KiB chunks)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "torch_dtype": "bfloat16", "vocab_size": 1024,
}
CPU = CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "vec")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15 - 1, (2, 2, tokens, 128), generator=g,
                         dtype=torch.int16).view(torch.bfloat16)


def _cold(stats: dict[str, int]) -> int:
    return stats["cold_regions"]


def test_per_token_stores_into_cold_and_warm_slots() -> None:
    with LMCacheServer(shm=True, l1_size_gb=0.25) as srv:
        name = unique_model_name("cold-store")
        iid = register_engine_driven(srv.url, name, block_size=128, use_mla=True, hidden=256)
        try:
            with lmc_sdk.connect(srv.url, srv.http_url, name, timeout=30,
                                 model_config=CONFIG, kernel="vec") as ctx:
                assert ctx.engine_kv == CPU
                chunks = 1024 // ctx.chunk_size
                toks = list(range(100, 1124))
                kv = _kv(1024, 1)
                before = _native.copy_stats()
                assert ctx.store(kv, toks)
                after = _native.copy_stats()
                # every chunk went into pages the pool never held: the cold-page path
                assert _cold(after) - _cold(before) == chunks
                assert torch.equal(_bits(ctx.retrieve(toks)), _bits(kv))
                assert torch.equal(_bits(ctx.retrieve(toks, raw=True)), _bits(CPU.to_raw(kv)))

                written = srv.warm_pool()
                assert 0 < written < srv.l1_size_gb * 2**30
                assert srv.warm_pool() == 0  # nothing left to allocate
                # the stored object kept its bytes
                assert torch.equal(_bits(ctx.retrieve(toks)), _bits(kv))

                other = [t + 5000 for t in toks]
                kv2 = _kv(1024, 2)
                before = _native.copy_stats()
                assert ctx.store(kv2, other)
                # allocated slots: converted straight into them, no cold region
                assert _cold(_native.copy_stats()) == _cold(before)
                assert torch.equal(_bits(ctx.retrieve(other)), _bits(kv2))
                assert torch.equal(_bits(ctx.retrieve(toks)), _bits(kv))
        finally:
            unregister_engine_driven(srv.url, iid)


def test_warm_pool_of_a_pickle_server_is_a_no_op() -> None:
    with LMCacheServer(shm=False, l1_size_gb=0.25) as srv:
        assert srv.warm_pool() == 0
