"""Peak memory of ``batch.rewrite``: is it bounded by what is in flight, whatever the length?

Not part of CI. Starts a real SHM server, seeds ``--sequences`` prompts one at a time
(``store_many`` over a generator, so seeding keeps at most one KV alive), then rewrites them
all (drop every 10th token; ``--edit alloc``: ``fn`` writes into rewrite's ``alloc``;
``plain``: ``kv.index_select`` into a fresh tensor, pooled by rewrite) while a sampler
thread reads the process's private RSS (``RssAnon``) every 5 ms. Prints the RSS before the
batch, the peak during it, and the peak growth in units of one sequence's KV, for each
edit and batch length given, in one process:

    .venv/bin/python benches/bench_batch_memory.py --sequences 8,32,64 --layers 8

A bounded batch shows the same growth for every length (at most ``max_in_flight``
sequences alive, each holding its retrieved KV and its edit, plus the kept pools), far
below the batch.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import random
import threading
import time
from collections.abc import Iterator

import torch

from benches.harness.edits import drop_every_kth
from lmcache_kv_fast import batch, kvcache
from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

logger = logging.getLogger("bench_batch_memory")


def rss_bytes() -> int:
    """Private resident memory of this process (``RssAnon`` of ``/proc/self/status``).

    The server's L1 pool pages this process has mapped show up as ``RssShmem``; they are
    the server's cache (counted once, in the server), not the batch's memory.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Sample RSS every ``period`` seconds in a thread; ``peak`` is the largest seen."""

    def __init__(self, period: float = 0.005) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


def drop_every_10th(kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The plain edit: a fresh output tensor every call."""
    keep = [i for i in range(len(tokens)) if i % 10 != 9]
    return kv.index_select(2, torch.tensor(keep)), [tokens[i] for i in keep]


def trim() -> None:
    """Collect garbage; give freed heap memory and the idle warm buffers back to the OS.

    Every batch then starts with no pooled buffers, so its growth is its whole working set
    (a later batch would reuse what the pool kept instead of growing).
    """
    gc.collect()
    batch.release_buffers()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", default="8,32,64", help="batch lengths, comma-separated")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-in-flight", type=int, default=batch.REWRITE_MAX_IN_FLIGHT)
    ap.add_argument("--l1-gb", type=float, default=12.0)
    ap.add_argument("--edit", default="alloc,plain", help="edits to run: alloc, plain")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lengths = [int(x) for x in args.sequences.split(",")]
    kv_bytes = 2 * args.layers * args.tokens * 1024 * 2
    logger.info("KV per sequence: [2, %d, %d, 1024] bf16 = %.1f MiB; max_in_flight %d",
                args.layers, args.tokens, kv_bytes / 2**20, args.max_in_flight)
    with LMCacheServer(shm=True, l1_size_gb=args.l1_gb) as srv:
        register_vllm_layout(srv.url, "mem", num_layers=args.layers, num_kv_heads=8,
                             head_size=128)
        with kvcache.connect(srv.url, srv.http_url, "mem", timeout=60) as ctx:
            rows = []
            edits = {
                "alloc": lambda kv, t, *, alloc: drop_every_kth(kv, t, 10, alloc=alloc),
                "plain": drop_every_10th,
            }
            for edit, n in ((e, n) for e in args.edit.split(",") for n in lengths):
                ctx.clear(force=True)
                rng = random.Random(n)
                prompts = [[rng.randrange(0, 100_000) for _ in range(args.tokens)]
                           for _ in range(n)]

                def items(prompts: list[list[int]] = prompts) -> Iterator[tuple[torch.Tensor,
                                                                                 list[int]]]:
                    for i, p in enumerate(prompts):
                        g = torch.Generator().manual_seed(i)
                        yield torch.randn(ctx.kv_shape(args.tokens), generator=g).to(ctx.dtype), p

                seeded = batch.store_many(ctx, items())
                assert seeded.ok == n, seeded.summary()
                trim()
                before = rss_bytes()
                t0 = time.perf_counter()
                with PeakSampler() as peak:
                    rep = batch.rewrite(ctx, prompts, edits[edit],
                                        max_in_flight=args.max_in_flight, progress=False)
                dt = time.perf_counter() - t0
                assert rep.ok == n, rep.summary()
                growth = peak.peak - before
                rows.append((edit, n, before, peak.peak, growth, dt))
                logger.info("%-5s %4d sequences (%.2f GiB of KV): RSS before %.0f MiB, peak "
                            "%.0f MiB, growth %.0f MiB = %.2f x one KV; %.2f s", edit, n,
                            n * kv_bytes / 2**30,
                            before / 2**20, peak.peak / 2**20, growth / 2**20,
                            growth / kv_bytes, dt)
                trim()
    for edit in args.edit.split(","):
        growths = [r[4] for r in rows if r[0] == edit]
        spread = max(growths) - min(growths)
        logger.info("%s: growth spread across lengths: %.0f MiB (%.2f x one KV)", edit,
                    spread / 2**20, spread / kv_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
