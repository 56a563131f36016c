"""Batch token dropping: rewrite many cached prompts at once with ``batch.rewrite``.

Seeds ``--prompts`` random prompts (standing in for what vLLM cached) with
``batch.store_many``, rewrites every one — retrieve, drop every k-th token, store the edit
under the new token ids — with ``batch.rewrite``, then reads a sample of the edits back
with ``batch.retrieve_many`` and checks them bit for bit.

Run against a server you already have::

    python examples/batch_rewrite.py --url tcp://127.0.0.1:5555 \
        --http-url http://127.0.0.1:8080 --model Qwen/Qwen3-8B

or let it start a local real server (needs ``lmcache`` installed, as ``./scripts/run.sh``
does)::

    python examples/batch_rewrite.py --local --prompts 64
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
from collections.abc import Callable

import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import batch

logger = logging.getLogger("batch_rewrite")


def drop_every_kth(k: int) -> Callable[..., tuple[torch.Tensor, list[int]]]:
    """The edit: drop tokens k-1, 2k-1, ... from the KV (dimension -2) and the token ids.

    It writes into ``alloc``'s reused, pre-faulted buffers: a fresh output tensor of a
    large KV costs more in page faults than the edit itself.
    """

    def fn(kv: torch.Tensor, tokens: list[int], *,
           alloc: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        keep = [i for i in range(len(tokens)) if (i + 1) % k]
        out = alloc((*kv.shape[:-2], len(keep), kv.shape[-1]), kv.dtype)
        torch.index_select(kv, -2, torch.tensor(keep), out=out)
        return out, [tokens[i] for i in keep]

    return fn


def run(url: str, http_url: str, model: str, *, prompts: int = 16, tokens: int = 2048,
        k: int = 10, check: int = 4, seed: int = 0, progress: bool = True) -> bool:
    """Seed, rewrite and check ``prompts`` prompts. Returns success."""
    rng = random.Random(seed)
    token_lists = [[rng.randrange(0, 100_000) for _ in range(tokens)] for _ in range(prompts)]
    with lmc_sdk.connect(url, http_url, model, timeout=30) as ctx:
        logger.info("connected: %r", ctx)
        # Stand-in KV for what vLLM cached: one random tensor, rolled along the tokens by
        # the prompt's index, so every prompt has its own KV without generating each one.
        base = torch.randn(ctx.kv_shape(tokens), generator=torch.Generator().manual_seed(seed))
        base = base.to(ctx.dtype)

        def kv_of(i: int) -> torch.Tensor:
            return torch.roll(base, shifts=i, dims=-2)

        # Generated lazily: store_many keeps only max_in_flight of them alive at once.
        rep = batch.store_many(ctx, ((kv_of(i), t) for i, t in enumerate(token_lists)),
                               progress=progress)
        logger.info("seeded: %s", rep.summary())
        if rep.ok != prompts:
            logger.error("seeding failed: %s", rep.errors[:3])
            return False

        edit = drop_every_kth(k)
        rep = batch.rewrite(ctx, token_lists, edit, progress=progress)  # logs its summary
        if rep.ok != prompts:
            logger.error("rewrite failed for some prompts: %s", rep.errors[:3])
            return False

        # Read a sample back under the new token ids and compare with the edit.
        keep = [i for i in range(tokens) if (i + 1) % k]
        sample = rng.sample(range(prompts), min(check, prompts))
        new_lists = [[token_lists[i][j] for j in keep] for i in sample]
        whole = len(keep) // ctx.chunk_size * ctx.chunk_size
        ok = True
        for j, kv in batch.retrieve_many(ctx, new_lists):
            want = kv_of(sample[j]).index_select(-2, torch.tensor(keep)).narrow(-2, 0, whole)
            same = kv is not None and kv.shape[-2] == whole and torch.equal(kv, want)
            ok &= same
            logger.info("prompt %d: edit read back %s (%d whole-chunk tokens)", sample[j],
                        "EXACTLY" if same else "WRONG", whole)
        return ok


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--http-url")
    ap.add_argument("--model", default="demo/llama-like-8b")
    ap.add_argument("--local", action="store_true", help="start a local real server")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("-k", type=int, default=10, help="drop every k-th token")
    ap.add_argument("--check", type=int, default=4, help="prompts read back and compared")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with contextlib.ExitStack() as stack:
        if args.local or not args.url:
            from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

            per_prompt = 2 * 32 * args.tokens * 1024 * 2  # the registered model's KV bytes
            gib = max(1.0, 2.5 * args.prompts * per_prompt / 2**30)
            srv = stack.enter_context(LMCacheServer(shm=True, l1_size_gb=round(gib, 1)))
            register_vllm_layout(srv.url, args.model, num_layers=32, num_kv_heads=8,
                                 head_size=128)
            url, http_url = srv.url, srv.http_url
        else:
            url, http_url = args.url, args.http_url
        return 0 if run(url, http_url, args.model, prompts=args.prompts, tokens=args.tokens,
                        k=args.k, check=args.check) else 1


if __name__ == "__main__":
    sys.exit(main())
