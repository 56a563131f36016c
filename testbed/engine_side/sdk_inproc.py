"""The sdk package's token-dropping workflow inside the engine process, with the in-process hook.

Loaded by ``llm_driver.py``'s ``sdk_workflow`` op only (the driver itself never imports
``lmcache_kv_fast``): it puts the repository on ``sys.path``, connects
``lmcache_kv_fast.sdk`` to the LMCache server the engine writes into, and runs prefill →
modify (drop every n-th token) → decode over a batch of streams whose engine hook is
``VllmLLMCompletion(llm)`` — the driver's own ``vllm.LLM``.
"""

from __future__ import annotations

import sys
from typing import Any


def drop_every(n: int) -> Any:
    """The edit: drop every ``n``-th token's K/V (per-token ``[2, L, T, D]``) and id."""

    def fn(tensors: Any, tokens: list[int]) -> Any:
        import torch

        import lmcache_kv_fast.sdk as lmc_sdk

        kv = tensors[lmc_sdk.LMCacheSDKCacheKind.KV]
        keep = [i for i in range(kv.shape[-2]) if i % n != n - 1]
        return kv.index_select(kv.dim() - 2, torch.tensor(keep)), [tokens[i] for i in keep]

    return fn


def run(llm: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the workflow; return every stream's tokens and the three reports."""
    if cfg["repo_root"] not in sys.path:
        sys.path.insert(0, cfg["repo_root"])
    import lmcache_kv_fast.sdk as lmc_sdk
    from lmcache_kv_fast.sdk.hooks import VllmLLMCompletion

    ctx = lmc_sdk.connect(lmc_sdk.LMCacheSDKCacheKind.KV, cfg["url"], cfg["http_url"],
                          cfg["model"], **cfg.get("connect_options", {}))
    try:
        hook = VllmLLMCompletion(llm)
        batch = lmc_sdk.batch.LMCacheBatchedStream()
        streams = [lmc_sdk.request.create_request([ctx], hook, p, cache_salt=cfg["salt"])
                   for p in cfg["prompts"]]
        for s in streams:
            batch.add(s)
        sp = dict(cfg["sampling_params"])
        pre = batch.prefill(sp)
        mod = batch.modify(drop_every(int(cfg["drop_every"])))
        edited = [list(s.tokens) for s in streams]
        dec = batch.decode({**sp, "max_tokens": int(cfg["max_tokens"])})
        return {
            "tokens": [list(s.tokens) for s in streams],
            "edited": edited,
            "output_tokens": [s.output_tokens for s in streams],
            "decode_cached": [batch.perf_metrics[s.request_stream_id].cached_tokens
                              for s in streams],
            "reports": {"prefill": pre.to_dict(), "modify": mod.to_dict(),
                        "decode": dec.to_dict()},
        }
    finally:
        ctx.close()
