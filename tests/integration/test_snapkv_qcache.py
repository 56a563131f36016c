"""SnapKV from the query cache of a real LMCache server: the same tokens as given queries.

The engine venv's vLLM cannot export query tensors unpatched, so the queries come from
transformers on the same weights (``TransformersOracle.window_attention``, the tiny Llama:
2 layers, 4 query heads on 2 KV heads of 64) and go into a real server's query cache the
way LMCache's engine adapter stores them (``QueryExporter``: the server version's own
``LMCacheDrivenTransferContext``; ``--enable transfer_query`` on 0.5.6, the ``qstore``
module on 0.5.7). The prompts' KV (the oracle's) is stored through the SDK's KV context.
A batched stream with a KV and a QUERY context then runs ``edits.snapkv()`` without
queries, as users do: it must keep exactly the tokens the same edit keeps given the
queries by the caller, store that edit bit for bit, and — in float32 — keep what a plain
reference over transformers' own attention probabilities keeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import SERVER_VERSION, start_server, unique_model_name

import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast import edits
from lmcache_kv_fast.testing import LMCacheServer
from testbed.engine_proc import EngineChildError, engine_python
from testbed.query_export import QueryExporter, query_server_kwargs

KV, QUERY = lmc_sdk.LMCacheSDKCacheKind.KV, lmc_sdk.LMCacheSDKCacheKind.QUERY
CHUNK, CACHED, W, KERNEL = 256, 512, 32, 7
PROMPTS = {"aligned": 512, "with_tail": 700}  # whole chunks only / 188 tokens past them


@pytest.fixture(scope="module")
def oracle_runs() -> dict[str, dict]:
    """Per prompt: its tokens, its KV (all of it), and the 512 queries and attention rows
    of its cached prefix (transformers, float32), from the tiny Llama."""
    from testbed.oracle import TransformersOracle
    from testbed.tiny_model import ensure_tiny_model

    try:
        engine_python()
        model = ensure_tiny_model()
    except EngineChildError as exc:
        pytest.skip(f"transformers oracle unavailable: {exc}")
    runs = {}
    with TransformersOracle(model) as oracle:
        for seed, (name, n) in enumerate(PROMPTS.items()):
            gen = torch.Generator().manual_seed(100 + seed)
            tokens = torch.randint(0, 1024, (n,), generator=gen).tolist()
            q, att = oracle.window_attention(tokens[:CACHED], CACHED)
            runs[name] = {"tokens": tokens, "kv": oracle.kv(tokens),
                          "q": q.permute(0, 2, 1, 3).reshape(2, CACHED, -1), "att": att}
    runs["rope"] = edits.rope_from_config(model)
    return runs


@pytest.fixture(scope="module")
def qserver() -> Iterator[LMCacheServer]:
    """A real server of the suite's version with the query module, chunk 256."""
    yield from start_server(True, chunk_size=CHUNK, l1_size_gb=0.5,
                            **query_server_kwargs(SERVER_VERSION))


def reference(att: torch.Tensor, kept: int) -> list[int]:
    """SnapKV over transformers' probabilities of the last W rows (max pool, mean)."""
    count = att.shape[-1]
    score = att[:, :, -W:].sum(dim=2)[..., : count - W].reshape(-1, 1, count - W)
    total = F.max_pool1d(score, KERNEL, 1, KERNEL // 2).reshape(-1, count - W).mean(dim=0)
    top = torch.sort(total, descending=True, stable=True).indices[: kept - W]
    return sorted(top.tolist()) + list(range(count - W, count))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_snapkv_from_the_query_cache(qserver, oracle_runs, dtype: str) -> None:
    """The stream's QUERY tensor (read from the server) selects what given queries select."""
    name, dt, rope = unique_model_name("snapq"), getattr(torch, dtype), oracle_runs["rope"]
    with QueryExporter(qserver.url, name, num_layers=2, num_kv_heads=2, head_size=64,
                       num_q_heads=4, chunk_size=CHUNK, dtype=dtype,
                       python=qserver.python) as exporter:
        kctx = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, name)
        qctx = lmc_sdk.qcache.connect(qserver.url, qserver.http_url, name)
        try:
            batch, want = lmc_sdk.batch.LMCacheBatchedStream(), {}
            for key in PROMPTS:
                run = oracle_runs[key]
                s = lmc_sdk.request.create_request([kctx, qctx], lambda *a: iter(()),
                                                   run["tokens"])
                full, q = run["kv"].to(dt), run["q"].to(dt)
                s.update(KV, full, s.tokens)  # the prompt's KV: its whole chunks are stored
                assert exporter.store_query(run["tokens"][:CACHED], q)
                kv = full[:, :, :CACHED]
                assert torch.equal(bits(s.retrieve(QUERY)[0]), bits(q))  # qcache: bit-exact
                given = edits.snapkv(q, W, KERNEL, ratio=0.5, rope=rope)
                want[s.request_stream_id] = (s, *given(kv, run["tokens"][:CACHED]), key)
                batch.add(s)
            batch.modify(edits.snapkv(None, W, KERNEL, ratio=0.5, rope=rope))
            for s, want_kv, want_tokens, key in want.values():
                run = oracle_runs[key]
                assert s.tokens == want_tokens and len(want_tokens) == CACHED // 2
                assert s.suffix_tokens == run["tokens"][CACHED:]
                assert torch.equal(bits(kctx.retrieve(s.tokens)), bits(want_kv))
                if dtype == "float32":  # the same tokens as transformers' own attention
                    idx = reference(run["att"], CACHED // 2)
                    assert s.tokens == [run["tokens"][i] for i in idx]
        finally:
            kctx.close()
            qctx.close()
