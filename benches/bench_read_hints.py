"""Retrieve latency with read hints, without them, and with a stale hint, side by side.

One context against a local real server (SHM plane). Per rep, in rotating order: a
retrieve that reads from the prefix's hinted slots while ``prepare_retrieve`` is answered
(``hinted``), one with hints off (``plain``) and one whose hint was made stale first (the
chunk order reversed: the reply names other slots, so the chunks are copied twice); drop-in
calls and calls into a reused ``out``. Two patterns: ``separated`` (a flat memcpy of the
same bytes, the roofline, runs before every call, like other work between calls: the
server has finished the previous call's deferred release) and ``back-to-back`` (the next
call's requests queue behind that release; the roofline is timed once per rep). Prints
medians, hinted / plain, stale / plain and each flow's fraction of the roofline (median of
per-rep ratios). ``--pin`` gives the server a core of its own (the server's threads on
CPU 1, this process and one copy thread on CPU 0), as on a host with cores to spare: the
server's handling of ``prepare_retrieve`` then overlaps the copy instead of taking a core
from it.

    python benches/bench_read_hints.py [--reps 100] [--sizes w2,w1] [--pin]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import KVLayout, _native
from lmcache_kv_fast.testing.server import LMCacheServer

logger = logging.getLogger("bench_read_hints")

#: name -> (layers, tokens): W2 is one 256-token chunk of a 28-layer model, W1 0.5 GiB.
SIZES = {"w2": (28, 256), "w1": (32, 4096)}
FLOWS = ("hinted", "plain", "stale")
#: Chunks each call read before its prepare_retrieve reply arrived.
_EARLY: dict[str, list[int]] = {f: [] for f in FLOWS}


def _retrieve(ctx: Any, toks: list[int], out: torch.Tensor | None, flow: str,
              key: tuple[Any, ...], spare: Any) -> float:
    ctx._read_hints = flow != "plain"
    if flow == "stale":  # reversed chunks; one chunk: another object of the same size
        slots = ctx._slot_hints[key]
        ctx._slot_hints[key] = slots[::-1] if len(slots) > 1 else [spare]
    t0 = time.perf_counter()
    got = ctx.retrieve(toks, out=out)
    dt = time.perf_counter() - t0
    t = ctx.last_timing
    # chunks are read from the hint only until the reply is there: hinted/rehinted <= n
    bad = {"hinted": t.rehinted, "plain": t.hinted + t.rehinted, "stale": t.hinted}[flow]
    if got is None or bad:
        raise RuntimeError(f"{flow} retrieve: hinted/rehinted {t.hinted}/{t.rehinted}")
    _EARLY[flow].append(t.hinted + t.rehinted)
    return dt


def _pin(pid: int, cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of ``pid``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def run(size: str, reps: int, pin: bool = False) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Seconds per call of every flow and the roofline, per (pattern, call kind)."""
    layers, tokens = SIZES[size]
    nbytes = 2 * layers * tokens * 1024 * 2
    lay = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    res: dict[tuple[str, str], dict[str, list[float]]] = {}
    with LMCacheServer(l1_size_gb=max(1.0, 4 * nbytes / 2**30)) as srv, \
            lmc_sdk.connect(srv.url, srv.http_url, f"bench-hints-{size}", layout=lay,
                            copy_threads=1 if pin else None) as ctx:
        if pin:
            assert srv.proc is not None
            _pin(srv.proc.pid, {1})
            _pin(os.getpid(), {0})
        kv = torch.randn(2, layers, tokens, 1024).to(torch.bfloat16)
        toks = list(range(tokens))
        spare = list(range(10**6, 10**6 + 256))
        if not ctx.store(kv, toks) or not ctx.store(kv[:, :, :256].contiguous(), spare):
            raise RuntimeError("seeding store failed")
        key = ("", tokens, hash(tuple(toks)), 0)  # the prefix's hint (context._same_key)
        spare_slot = ctx._slot_hints[("", 256, hash(tuple(spare)), 0)][0]
        dst = torch.empty_like(kv)
        def roofline() -> float:
            t0 = time.perf_counter()
            _native.memcpy(dst.data_ptr(), kv.data_ptr(), nbytes)
            return time.perf_counter() - t0

        for pattern in ("separated", "back-to-back"):
            for mode, out in (("drop-in", None), ("out", torch.empty_like(kv))):
                # per flow: its calls and the roofline copies paired with them
                times: dict[str, list[float]] = {k: [] for f in FLOWS for k in (f, f"roof {f}")}
                for _ in range(3):  # warm-up: pools, pages (a stale call corrects the hint)
                    for flow in FLOWS:
                        _retrieve(ctx, toks, out, flow, key, spare_slot)
                for i in range(reps):
                    for flow in FLOWS[i % 3:] + FLOWS[:i % 3]:
                        if pattern == "separated":
                            times[f"roof {flow}"].append(roofline())
                        times[flow].append(_retrieve(ctx, toks, out, flow, key, spare_slot))
                    if pattern == "back-to-back":
                        r = roofline()
                        for flow in FLOWS:
                            times[f"roof {flow}"].append(r)
                if out is not None and not torch.equal(out, kv):
                    raise RuntimeError("retrieve into out is not bit-exact")
                res[(pattern, mode)] = times
    return res


def main() -> None:
    """Run and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--sizes", default="w2,w1")
    ap.add_argument("--pin", action="store_true",
                    help="server threads on CPU 1; this process, 1 copy thread, on CPU 0")
    args = ap.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin needs CPUs 0 and 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("%-4s %-12s %-8s %9s %9s %9s %9s %12s %11s %s", "size", "pattern", "call",
                "hinted ms", "plain ms", "stale ms", "memcpy ms", "hinted/plain",
                "stale/plain", "x roof hinted / plain / stale")
    for size in args.sizes.split(","):
        reps = args.reps if size == "w2" else max(10, args.reps // 5)
        for (pattern, mode), t in run(size, reps, args.pin).items():
            med = {f: statistics.median(t[f]) for f in FLOWS}
            roof = {f: statistics.median(r / x for r, x in zip(t[f"roof {f}"], t[f], strict=True))
                    for f in FLOWS}
            memcpy = statistics.median(x for f in FLOWS for x in t[f"roof {f}"])
            logger.info("%-4s %-12s %-8s %9.2f %9.2f %9.2f %9.2f %12.3f %11.3f "
                        "%.3f / %.3f / %.3f", size, pattern, mode, med["hinted"] * 1e3,
                        med["plain"] * 1e3, med["stale"] * 1e3, memcpy * 1e3,
                        med["hinted"] / med["plain"], med["stale"] / med["plain"],
                        roof["hinted"], roof["plain"], roof["stale"])

if __name__ == "__main__":
    main()
