"""Soak test: mixed store / retrieve / lookup for minutes against a real LMCache server.

Not part of CI. Starts its own server (SHM or pickle plane) unless ``--url`` is given,
runs ``--threads`` threads over ``--contexts`` contexts for ``--minutes``, and prints every
``--every`` seconds: operations, ops/s, mismatches, errors, the client's RSS and the
server's L1 use. At the end it closes every context and prints what the server still
holds (sessions, prefetch jobs, read/write locks, staged objects) and the RSS trend.

    .venv/bin/python benches/soak.py --minutes 3 --threads 8

Exit status: 0 when there were no mismatches, no errors and no leftovers; 1 otherwise.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import Counter
from typing import Any

import torch

import lmcache_kv_fast as lkf
from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout
from lmcache_kv_fast.transport.http import HttpInfoClient


def rss_mib() -> tuple[float, float]:
    """(anonymous, shared-memory) resident MiB of this process: the mapped SHM pool pages
    count in the second; a leak would show in the first."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                vals[line.split(":")[0]] = int(line.split()[1]) / 1024
    return vals.get("RssAnon", float("nan")), vals.get("RssShmem", float("nan"))


def pooled_mib() -> float:
    """Idle result buffers the native core keeps for reuse (bounded; part of anon RSS)."""
    if lkf.backend() != "native":
        return 0.0
    from lmcache_kv_fast import _native

    return _native.result_pool_stats()["pooled_bytes"] / 2**20


def leftovers(http: HttpInfoClient) -> dict[str, Any]:
    st = http.status()
    l1 = st["storage_manager"]["l1_manager"]
    return {"active_sessions": st["active_sessions"],
            "active_prefetch_jobs": st["active_prefetch_jobs"],
            "read_locked_count": l1["read_locked_count"],
            "write_locked_count": l1["write_locked_count"],
            "staging_object_count": l1.get("staging_object_count", 0)}


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, http_url: str, model: str) -> None:
        self.args = args
        self.http = HttpInfoClient(http_url, 10)
        self.contexts = [lkf.connect(url, http_url, model, timeout=args.timeout)
                         for _ in range(args.contexts)]
        ctx = self.contexts[0]
        self.c = ctx.chunk_size
        self.shape = ctx.kv_shape(0)
        self.dtype = ctx.dtype
        rng = random.Random(0)
        self.pool = [self._seq(rng, 1 + i % args.max_chunks, seed=i) for i in range(args.pool)]
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.mismatches = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _seq(self, rng: random.Random, chunks: int, seed: int) -> tuple[list[int], torch.Tensor]:
        t = chunks * self.c
        toks = [rng.randrange(0, 2**31) for _ in range(t)]
        shape = list(self.shape)
        shape[-2] = t
        g = torch.Generator().manual_seed(seed)
        return toks, torch.randn(shape, generator=g).to(self.dtype)

    def _check(self, got: torch.Tensor | None, kv: torch.Tensor) -> bool:
        if got is None:
            return True  # a miss (never stored yet, or evicted) is not a mismatch
        n = got.shape[-2]
        want = kv[..., :n, :]
        return got.shape == want.shape and torch.equal(got.view(torch.int16),
                                                       want.view(torch.int16))

    def worker(self, wid: int) -> None:
        ctx = self.contexts[wid % len(self.contexts)]
        rng = random.Random(1000 + wid)
        local: Counter[str] = Counter()
        bad = 0
        errs: list[str] = []
        seq_seed = 10**6 * (wid + 1)
        while not self.stop.is_set():
            op = rng.choices(("store", "retrieve", "retrieve_out", "lookup", "fresh"),
                             weights=(3, 3, 2, 2, 1))[0]
            toks, kv = self.pool[rng.randrange(len(self.pool))]
            try:
                if op == "store":
                    ctx.store(kv, toks)
                elif op == "retrieve":
                    bad += not self._check(ctx.retrieve(toks), kv)
                elif op == "retrieve_out":
                    bad += not self._check(ctx.retrieve(toks, out=torch.empty_like(kv)), kv)
                elif op == "lookup":
                    ctx.lookup(toks)
                else:  # a never-seen sequence: stored, then read back at once if True
                    seq_seed += 1
                    ftoks, fkv = self._seq(rng, rng.randint(1, self.args.max_chunks), seq_seed)
                    if ctx.store(fkv, ftoks):
                        got = ctx.retrieve(ftoks)
                        bad += got is None or got.shape != fkv.shape or not self._check(got, fkv)
            except lkf.KVCacheSDKError as err:
                errs.append(f"{op}: {err}")
            local[op] += 1
            if sum(local.values()) >= 50:
                with self.lock:
                    self.counts.update(local)
                    self.mismatches += bad
                    self.errors.extend(errs)
                local.clear()
                bad = 0
                errs = []
        with self.lock:
            self.counts.update(local)
            self.mismatches += bad
            self.errors.extend(errs)

    def run(self) -> int:
        args = self.args
        threads = [threading.Thread(target=self.worker, args=(w,), daemon=True)
                   for w in range(args.threads)]
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        rss: list[tuple[float, float]] = [(0.0, rss_mib()[0])]
        print(f"soak: {args.threads} threads over {args.contexts} context(s), "
              f"{self.contexts[0].transport} plane, kv {list(self.shape)} "
              f"{str(self.dtype).removeprefix('torch.')}, chunk {self.c}, "
              f"{args.minutes:g} min", flush=True)
        print(f"{'t[s]':>6} {'ops':>8} {'ops/s':>7} {'mism':>5} {'err':>4} {'anon[MiB]':>9} "
              f"{'shm[MiB]':>9} {'pool[MiB]':>9} {'L1 used':>8}", flush=True)
        for t in threads:
            t.start()
        last_ops, last_t = 0, t0
        while (now := time.monotonic()) < end:
            time.sleep(min(args.every, max(0.0, end - now)))
            now = time.monotonic()
            with self.lock:
                ops = sum(self.counts.values())
                mism, nerr = self.mismatches, len(self.errors)
            r, shm = rss_mib()
            rss.append((now - t0, r))
            try:
                used = self.http.status()["storage_manager"]["l1_manager"]["memory_usage_ratio"]
                used_s = f"{100 * used:.0f}%"
            except (lkf.KVCacheSDKError, KeyError, TypeError):
                used_s = "?"
            print(f"{now - t0:6.0f} {ops:8d} {(ops - last_ops) / (now - last_t):7.0f} {mism:5d} "
                  f"{nerr:4d} {r:9.0f} {shm:9.0f} {pooled_mib():9.0f} {used_s:>8}", flush=True)
            last_ops, last_t = ops, now
        self.stop.set()
        for t in threads:
            t.join(args.timeout * 4)
        hung = [t.name for t in threads if t.is_alive()]
        for ctx in self.contexts:
            ctx.close()
        left: dict[str, Any] = {}
        for _ in range(50):  # the server finishes cleanup calls asynchronously
            left = leftovers(self.http)
            if not any(left.values()):
                break
            time.sleep(0.1)
        total = sum(self.counts.values())
        third = max(1, len(rss) // 3)
        early = max(r for _, r in rss[1:third + 1]) if len(rss) > 1 else rss[0][1]
        late = max(r for _, r in rss[-third:])
        print(f"done: {total} ops in {time.monotonic() - t0:.0f}s ({dict(self.counts)}), "
              f"mismatches {self.mismatches}, errors {len(self.errors)}, hung threads {hung}")
        print(f"anonymous RSS: start {rss[0][1]:.0f} MiB, max of the first third "
              f"{early:.0f} MiB, max of the last third {late:.0f} MiB "
              f"(growth {late - early:+.0f} MiB)")
        print(f"leftovers after close: {left}")
        for e in self.errors[:10]:
            print(f"  error: {e}")
        ok = not self.mismatches and not self.errors and not hung and not any(left.values())
        return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--plane", choices=("shm", "pickle"), default="shm")
    ap.add_argument("--l1-gb", type=float, default=0.25,
                    help="L1 of the started server (small: eviction keeps churning)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--max-chunks", type=int, default=3)
    ap.add_argument("--pool", type=int, default=32, help="distinct sequences reused")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--every", type=float, default=15.0, help="report period in seconds")
    ap.add_argument("--url", help="use a running server (needs --http-url and --model)")
    ap.add_argument("--http-url")
    ap.add_argument("--model")
    args = ap.parse_args(argv)
    if args.url:
        if not (args.http_url and args.model):
            ap.error("--url needs --http-url and --model")
        return Soak(args, args.url, args.http_url, args.model).run()
    with LMCacheServer(shm=args.plane == "shm", l1_size_gb=args.l1_gb) as srv:
        model = "soak-model"
        register_vllm_layout(srv.url, model, num_layers=args.layers, num_kv_heads=args.heads,
                             head_size=args.head_size)
        return Soak(args, srv.url, srv.http_url, model).run()


if __name__ == "__main__":
    sys.exit(main())
