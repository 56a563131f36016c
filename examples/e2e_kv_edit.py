"""Token dropping end to end: retrieve a prefix's KV, drop every k-th token (KV and id),
store the edit under the new token sequence, retrieve it again and check it is the edit.

Run against a server you already have::

    python examples/e2e_kv_edit.py --url tcp://127.0.0.1:5555 --http-url http://127.0.0.1:8080 \
        --model Qwen/Qwen3-8B

or let it start a local real server (needs ``lmcache`` installed, as ``./scripts/run.sh``
does)::

    python examples/e2e_kv_edit.py --local
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import time

import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast.demo import drop_every_kth

logger = logging.getLogger("e2e_kv_edit")


def run(url: str, http_url: str, model: str, *, tokens: int = 2048, k: int = 10,
        seed: int = 0) -> bool:
    """Store a random prompt's KV, then do the token-dropping edit. Returns success."""
    rng = random.Random(seed)
    prompt = [rng.randrange(0, 100_000) for _ in range(tokens)]
    with lmc_sdk.connect(url, http_url, model, timeout=30) as ctx:
        logger.info("connected: %r (backend %s)", ctx, __import__("lmcache_kv_fast").backend())
        # 1. what vLLM would have stored for this prompt (random KV stands in for it)
        kv0 = torch.randn(ctx.kv_shape(tokens), dtype=torch.float32).to(ctx.dtype)
        assert lmc_sdk.store(ctx, kv0, prompt), "initial store failed"
        # 2. fetch the prefix's KV
        t0 = time.perf_counter()
        kv = lmc_sdk.retrieve(ctx, prompt)
        t1 = time.perf_counter()
        if kv is None:
            logger.error("nothing cached for the prompt")
            return False
        logger.info("retrieved %s %s in %.1f ms", tuple(kv.shape), kv.dtype, (t1 - t0) * 1e3)
        # 3. edit: drop every k-th token
        new_kv, new_tokens = drop_every_kth(kv, prompt[: kv.shape[-2]], k)
        # 4. store the edit under the new token sequence
        t2 = time.perf_counter()
        res = ctx.store_ex(new_kv, new_tokens)
        t3 = time.perf_counter()
        logger.info("stored edit: %d tokens -> %d; %s in %.1f ms", kv.shape[-2], len(new_tokens),
                    res, (t3 - t2) * 1e3)
        # 5. read it back and compare with the edit (whole chunks only)
        back = lmc_sdk.retrieve(ctx, new_tokens)
        whole = len(new_tokens) // ctx.chunk_size * ctx.chunk_size
        ok = back is not None and back.shape[-2] == whole and torch.equal(
            back, new_kv.narrow(-2, 0, whole))
        logger.info("edit read back %s (%d whole-chunk tokens)", "EXACTLY" if ok else "WRONG",
                    whole)
        return ok


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--http-url")
    ap.add_argument("--model", default="demo/llama-like-8b")
    ap.add_argument("--local", action="store_true", help="start a local real server")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("-k", type=int, default=10, help="drop every k-th token")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with contextlib.ExitStack() as stack:
        if args.local or not args.url:
            from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

            srv = stack.enter_context(LMCacheServer(shm=True, l1_size_gb=2))
            register_vllm_layout(srv.url, args.model, num_layers=32, num_kv_heads=8,
                                 head_size=128)
            url, http_url = srv.url, srv.http_url
        else:
            url, http_url = args.url, args.http_url
        return 0 if run(url, http_url, args.model, tokens=args.tokens, k=args.k) else 1


if __name__ == "__main__":
    sys.exit(main())
