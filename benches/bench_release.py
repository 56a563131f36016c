"""Retrieve latency with the release (``commit_retrieve``) awaited vs sent without waiting.

Runs both flows on one context against a local real server, side by side: alternating
(each call preceded by a call of the other flow, like calls separated by other work), in
tight loops over 8 distinct sequences, and in tight loops of one identical retrieve (each
call's commit then meets the next call on the server, and an identical key waits for the
previous commit's acknowledgement). Prints medians and deferred / awaited per size.

    python benches/bench_release.py [--reps 200] [--sizes w2,w1]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast.testing.register import register_vllm_layout
from lmcache_kv_fast.testing.server import LMCacheServer

logger = logging.getLogger("bench_release")

#: name -> (layers, tokens): W2 is one 256-token chunk of a 28-layer model, W1 0.5 GiB.
SIZES = {"w2": (28, 256), "w1": (32, 4096)}


def _timed(ctx: lmc_sdk.LMCacheKVCacheContext, toks: list[int], defer: bool) -> float:
    ctx._defer_releases = defer
    t0 = time.perf_counter()
    r = ctx.retrieve(toks)
    dt = time.perf_counter() - t0
    assert r is not None
    return dt


def run(size: str, reps: int) -> dict[str, float]:
    """Median seconds per retrieve of ``size`` for each flow and pattern."""
    layers, tokens = SIZES[size]
    l1_gb = max(1.0, 12 * 2 * layers * tokens * 1024 * 2 / 2**30)
    with LMCacheServer(l1_size_gb=l1_gb) as srv:
        model = f"bench-release-{size}"
        reg = register_vllm_layout(srv.url, model, num_layers=layers, num_kv_heads=8,
                                   head_size=128)
        try:
            with lmc_sdk.connect(srv.url, srv.http_url, model) as ctx:
                kv = torch.randn(2, layers, tokens, 1024).to(torch.bfloat16)
                seqs = [list(range(k * tokens, (k + 1) * tokens)) for k in range(8)]
                for s in seqs:
                    if not ctx.store(kv, s):
                        raise RuntimeError("seeding store failed")
                toks = seqs[0]
                for _ in range(5):  # warm-up: pools, pages, both flows
                    _timed(ctx, toks, True)
                    _timed(ctx, toks, False)
                alt: dict[bool, list[float]] = {True: [], False: []}
                for i in range(reps):
                    for defer in ((True, False) if i % 2 else (False, True)):
                        alt[defer].append(_timed(ctx, toks, defer))
                # tight loops in blocks of 10 calls, the flows' blocks alternating (drift and
                # bursts on a shared machine hit both alike)
                tight: dict[bool, list[float]] = {True: [], False: []}
                distinct: dict[bool, list[float]] = {True: [], False: []}
                for b in range(max(1, reps // 10)):
                    for defer in ((True, False) if b % 2 else (False, True)):
                        distinct[defer] += [_timed(ctx, seqs[i % 8], defer) for i in range(10)]
                        tight[defer] += [_timed(ctx, toks, defer) for _ in range(10)]
        finally:
            reg.unregister()
    return {"alt_awaited": statistics.median(alt[False]),
            "alt_deferred": statistics.median(alt[True]),
            "distinct_awaited": statistics.median(distinct[False]),
            "distinct_deferred": statistics.median(distinct[True]),
            "tight_awaited": statistics.median(tight[False]),
            "tight_deferred": statistics.median(tight[True])}


def main() -> None:
    """Run and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--sizes", default="w2,w1")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("%-4s %-22s %11s %12s %17s", "size", "pattern", "awaited ms", "deferred ms",
                "deferred/awaited")
    for size in args.sizes.split(","):
        reps = args.reps if size == "w2" else max(10, args.reps // 10)
        m = run(size, reps)
        names = {"alt": "alternating", "distinct": "tight, 8 sequences",
                 "tight": "tight, one sequence"}
        for pat, name in names.items():
            a, d = m[f"{pat}_awaited"], m[f"{pat}_deferred"]
            logger.info("%-4s %-22s %11.2f %12.2f %17.3f", size, name, a * 1e3, d * 1e3, d / a)


if __name__ == "__main__":
    main()
