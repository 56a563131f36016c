"""Token-dropping demo over a batch of sequences (``lmcache-kv-fast demo``).

Stores random "prompt" KV for N sequences (what vLLM would have cached), then rewrites
every sequence with :func:`lmcache_kv_fast.batch.rewrite`: retrieve → drop every k-th token
(KV and id) → store under the new token sequence, and verifies a sample bit-exact.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

import torch

from lmcache_kv_fast import batch
from lmcache_kv_fast.client.context import LMCacheKVCacheContext

logger = logging.getLogger(__name__)


def drop_every_kth(kv: torch.Tensor, tokens: Sequence[int], k: int = 10, *,
                   alloc: Callable[..., torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
    """Drop tokens ``k-1, 2k-1, ...`` from the KV tensor (dim -2) and the token list.

    Args:
        kv: ``[..., T, D]`` KV.
        tokens: Its ``T`` token ids.
        k: Drop every k-th token.
        alloc: Where to put the result (``batch.rewrite`` passes its pooled allocator);
            a fresh tensor when None.
    """
    keep = [i for i in range(len(tokens)) if (i + 1) % k != 0]
    index = torch.tensor(keep, dtype=torch.long)
    new_toks = [tokens[i] for i in keep]
    if alloc is None:
        return kv.index_select(-2, index).contiguous(), new_toks
    out = alloc((*kv.shape[:-2], len(keep), kv.shape[-1]), kv.dtype)
    return torch.index_select(kv, -2, index, out=out), new_toks


def run_batch_demo(ctx: LMCacheKVCacheContext, *, sequences: int = 32, tokens: int = 2048,
                   k: int = 10, seed: int = 0, progress: bool = True) -> batch.BatchReport:
    """Seed the cache with ``sequences`` prompts, rewrite them all, verify, return the report."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 100_000) for _ in range(tokens)] for _ in range(sequences)]
    gen = torch.Generator().manual_seed(seed)

    def seed_items():
        for p in prompts:
            yield torch.randn(ctx.kv_shape(tokens), generator=gen).to(ctx.dtype), p

    seeded = batch.store_many(ctx, seed_items(), progress=progress)
    logger.info("seeded the cache: %s", seeded.summary())
    report = batch.rewrite(ctx, prompts,
                           lambda kv, t, *, alloc: drop_every_kth(kv, t, k, alloc=alloc),
                           progress=progress)
    # verify a sample: the stored edit is exactly the edit of the original
    for p in prompts[:: max(1, sequences // 4)]:
        kv = ctx.retrieve(p)
        if kv is None:
            raise AssertionError("a seeded sequence is not cached")
        new_kv, new_toks = drop_every_kth(kv, p[: kv.shape[-2]], k)
        back = ctx.retrieve(new_toks)
        whole = len(new_toks) // ctx.chunk_size * ctx.chunk_size
        if back is None or not torch.equal(back, new_kv.narrow(-2, 0, whole)):
            raise AssertionError("a rewritten sequence does not read back as its edit")
    return report
