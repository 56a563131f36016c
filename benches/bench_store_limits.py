"""What bounds a warm W1 store here: the store against the ways of hiding the server's work.

A warm 0.5 GiB store (``[2, 32, 4096, 1024]`` bf16, 16 chunks) is ``prepare_store`` (the
server reserves 16 slots), the copy into them, ``commit_store``. Its copy already runs at
the flat-memcpy roofline; the rest is the two replies. This bench measures, side by side
in rotating order against one local real server (SHM plane), with a flat memcpy of the
same bytes (the roofline) before every call:

* ``plain``: ``ctx.store`` as shipped;
* ``split-K``: the store as two pipelined sub-ranges, chunks ``[0, K)`` and ``[K, 16)``:
  both ``prepare_store`` requests are sent at once, each part is copied as soon as its
  reply is in and committed right after its copy, so the server prepares the second part
  and commits the first one while this process copies (the only way a client can overlap
  the server's work with the copy: a slot must be reserved before a byte is written);
* ``prewarm``: the plain store, but a harmless request (``noop``) is fired before the last
  chunk is copied, so that the server's threads are awake when ``commit_store`` comes;

and a ``ping`` back to back versus right after the roofline copy (a "cold" round trip:
the server's threads slept and the caches were flushed by the copy). Prints per flow the
median time, its ratio to ``plain``, its fraction of the roofline (median of per-rep
ratios) and the time blocked on replies; for ``plain`` also the *ceiling*: the fraction a
client whose own work is free would reach (roofline / (roofline + waits)). Every flow's
data is checked bit-exact once. The variants use the SDK's private layer; they are
experiments, not features.

    python benches/bench_store_limits.py [--reps 20] [--splits 1,4,8] [--layers 32]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import statistics
import time
from typing import Any

import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import KVLayout, _native
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import PrepareStoreResponse
from lmcache_kv_fast.testing.server import LMCacheServer

logger = logging.getLogger("bench_store_limits")

LAYERS, TOKENS, HIDDEN = 32, 4096, 1024


def _store_parts(ctx: Any, src: torch.Tensor, toks: list[int], bounds: list[int],
                 prewarm: bool = False) -> float:
    """Store ``src`` as the pipelined sub-ranges ``bounds`` (chunk indices); return waits (s).

    One part (``[0, n]``) is the plain protocol sequence; ``prewarm`` fires a ``noop``
    before the last chunk's copy.
    """
    cs = ctx.chunk_size
    parts = list(itertools.pairwise(bounds))
    with ctx._op(None, name="store", t0=time.perf_counter()) as ch:
        w0 = ch.wait_s
        rid = ctx._rid("s")
        keys = [ctx._key(toks, a * cs, b * cs, rid, "", 0) for a, b in parts]
        calls = [ch.send(Op.PREPARE_STORE, [k, ctx.instance_id]) for k in keys]
        commits = []
        for (a, b), key, call in zip(parts, keys, calls, strict=True):
            resp = ch.wait(call, PrepareStoreResponse)
            idx = [a + i for i in resp.context.chunk_indices]
            if len(idx) != b - a:
                raise RuntimeError(f"prepare_store [{a}, {b}) reserved {len(idx)} chunks")
            regions = ctx._shm.regions(resp.context.slots, ctx._geom, ctx.layout.dtype_str,
                                       "prepare_store")
            if prewarm:
                ctx._copy(ctx._backend.scatter, src, idx[:-1], regions[:-1], 0)
                ch.fire(Op.NOOP, [])
                ctx._copy(ctx._backend.scatter, src, idx[-1:], regions[-1:], 0)
            else:
                ctx._copy(ctx._backend.scatter, src, idx, regions, 0)
            commits.append(ch.send(Op.COMMIT_STORE, [key, ctx.instance_id],
                                   raw=[codec.encode(b"")]))
        if not all(ch.wait(c, bool) for c in commits):
            raise RuntimeError("commit_store refused")
        ctx._end_session(ch, rid)
        return ch.wait_s - w0


def run(reps: int, splits: list[int], layers: int = LAYERS) -> dict[str, Any]:
    """Time every flow; return their samples (seconds) and the ping medians."""
    nbytes = 2 * layers * TOKENS * HIDDEN * 2
    lay = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    flows = ["plain", *(f"split-{k}" for k in splits), "prewarm"]
    t: dict[str, list[float]] = {k: [] for f in flows for k in (f, f"roof {f}", f"wait {f}")}
    rng = random.Random(0)
    with LMCacheServer(l1_size_gb=max(2.0, (len(flows) + 1) * nbytes / 2**30)) as srv, \
            lmc_sdk.connect(srv.url, srv.http_url, "bench-store-limits", layout=lay) as ctx:
        n = TOKENS // ctx.chunk_size
        src = torch.randn(2, layers, TOKENS, HIDDEN).to(torch.bfloat16)
        dst = torch.empty(nbytes, dtype=torch.uint8)

        def roofline() -> float:
            t0 = time.perf_counter()
            _native.memcpy(dst.data_ptr(), src.data_ptr(), nbytes)
            return time.perf_counter() - t0

        def call(flow: str, toks: list[int]) -> tuple[float, float]:
            t0 = time.perf_counter()
            if flow == "plain":
                if not ctx.store(src, toks):
                    raise RuntimeError("store refused")
                waits = ctx.last_timing.wait_s
            elif flow == "prewarm":
                waits = _store_parts(ctx, src, toks, [0, n], prewarm=True)
            else:
                waits = _store_parts(ctx, src, toks, [0, int(flow[6:]), n])
            return time.perf_counter() - t0, waits

        for rep in range(reps + 2):  # 2 warm-up reps
            srv.clear()
            for flow in flows[rep % len(flows):] + flows[:rep % len(flows)]:
                toks = [rng.randrange(1, 100_000) for _ in range(TOKENS)]
                r = roofline()
                dt, waits = call(flow, toks)
                if rep == 0:  # every flow stores what it was given, bit-exact
                    back = ctx.retrieve(toks)
                    if back is None or not torch.equal(back, src):
                        raise RuntimeError(f"{flow}: stored data does not come back exact")
                elif rep >= 2:
                    t[flow].append(dt)
                    t[f"roof {flow}"].append(r)
                    t[f"wait {flow}"].append(waits)
        ping_hot, ping_cold = [], []
        for _ in range(max(20, reps)):
            roofline()
            t0 = time.perf_counter()
            ctx.ping()
            ping_cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ctx.ping()
            ping_hot.append(time.perf_counter() - t0)
    return {"flows": flows, "t": t, "ping_hot": statistics.median(ping_hot),
            "ping_cold": statistics.median(ping_cold)}


def main() -> None:
    """Run and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--splits", default="1,4,8",
                    help="first sub-range sizes (chunks) of the split-K flows")
    ap.add_argument("--layers", type=int, default=LAYERS,
                    help="model layers (32: the 0.5 GiB W1 store; fewer for a quick run)")
    args = ap.parse_args()
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    splits = [int(x) for x in args.splits.split(",") if x]
    if any(not 1 <= k < TOKENS // 256 for k in splits):
        ap.error(f"--splits: each K must be in [1, {TOKENS // 256})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = run(args.reps, splits, args.layers)
    t = res["t"]
    plain = statistics.median(t["plain"])
    logger.info("%-9s %9s %9s %9s %8s %8s", "flow", "median ms", "x plain", "x roof",
                "waits ms", "ceiling")
    for f in res["flows"]:
        med = statistics.median(t[f])
        roof = statistics.median(r / x for r, x in zip(t[f"roof {f}"], t[f], strict=True))
        waits = statistics.median(t[f"wait {f}"])
        ceiling = ""
        if f == "plain":
            memcpy = statistics.median(t["roof plain"])
            ceiling = f"{memcpy / (memcpy + waits):.3f}"
        logger.info("%-9s %9.2f %9.3f %9.3f %8.2f %8s", f, med * 1e3, med / plain, roof,
                    waits * 1e3, ceiling)
    logger.info("memcpy (roofline) median %.2f ms; ping back to back %.3f ms, right after "
                "the roofline copy %.3f ms", statistics.median(t["roof plain"]) * 1e3,
                res["ping_hot"] * 1e3, res["ping_cold"] * 1e3)


if __name__ == "__main__":
    main()
