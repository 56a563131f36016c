"""Per-item overhead of a rewrite through Ray (one pinned actor) against the local batch engine.

Not part of CI. Starts one real SHM server and a single-node local Ray, then, side by side
in one run, rewrites W3 (``--sequences`` × ``--tokens`` tokens of ``[2, L, T, 1024]`` bf16,
drop every 10th token, ``fn`` writing into ``alloc``):

* ``local``: ``batch.rewrite`` in this process (the single-machine engine; each call makes
  its buffer pools anew);
* ``local-engine``: the actor's engine (``distributed._engine.ItemEngine``, buffers kept
  warm across calls) in this process, without Ray: ``ray`` minus this is Ray's own cost;
* ``ray``: ``Fleet([server]).rewrite(..., route=lambda t: 0)`` — the same work on the
  server's actor, driven from here (no routing cost);
* ``ray+lookup``: the same with the default lookup routing (one lookup fan-out).

Each variant starts from a cleared server seeded with fresh sequences (seeding is not
timed). It also measures the constants of the throughput model in docs/distributed.md: the
Ray round trip of an empty actor call, lookups through the actor (one Ray call for all
sequences) against lookups from the driver's own context, and the driver's routing cost per
sequence (chunk hashes for an events index; a route function)::

    .venv/bin/python benches/bench_distributed.py            # W3: 16 x 2048 tokens, 32 layers
    .venv/bin/python benches/bench_distributed.py --quick    # 6 x 1024 tokens, 8 layers

W3 needs ~10 GiB of free /dev/shm and memory (sources + edits resident in L1).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from typing import Any

import torch

from benches.harness.edits import drop_every_kth
from lmcache_kv_fast import KVLayout, batch, connect
from lmcache_kv_fast.testing import LMCacheServer

logger = logging.getLogger("bench_distributed")
MODEL = "bench-distributed"


def seed(ctx: Any, n: int, tokens: int, salt_seed: int) -> list[list[int]]:
    """Store ``n`` sequences of random KV under fresh token lists; return the token lists."""
    rng = random.Random(salt_seed)
    kv = torch.empty(ctx.kv_shape(tokens), dtype=torch.bfloat16)
    kv.view(torch.int16).random_(0, 16000)
    seqs = []
    for _ in range(n):
        toks = [rng.randrange(0, 2**31) for _ in range(tokens)]
        assert ctx.store(kv, toks)
        seqs.append(toks)
    return seqs


def check(ctx: Any, seqs: list[list[int]], kv_of: Any) -> None:
    """The edit of the first sequence is cached and right."""
    toks = seqs[0]
    src = kv_of(toks)
    want, new = drop_every_kth(src, toks)
    c = ctx.chunk_size
    new = new[: len(new) // c * c]
    got = ctx.retrieve(new)
    assert got is not None and torch.equal(got, want[..., : len(new), :]), "wrong edit"


def timed(f: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 sequences x 1024 tokens, 8 layers")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=1, help="runs of each variant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    ap.add_argument("--max-in-flight", type=int, default=3)
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args()
    if a.quick:
        a.sequences, a.tokens, a.layers = 6, 1024, 8
    logging.basicConfig(level=logging.WARNING)
    import os

    # A benchmark on a shared box: Ray's memory monitor would kill the actor when the
    # machine (other jobs included) nears its limit; the server's L1 is most of that.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    import ray

    from lmcache_kv_fast.distributed import Fleet, KVEventsIndex, Server
    from lmcache_kv_fast.hashing import chunk_hashes

    layout = KVLayout(a.layers, 8, 128, "bfloat16")
    seq_bytes = 2 * a.layers * a.tokens * 1024 * 2
    l1_gb = max(1.0, (2 * a.sequences * seq_bytes / 0.75 + seq_bytes) / 2**30)
    srv = LMCacheServer(shm=True, l1_size_gb=round(l1_gb + 0.5), startup_timeout=120).start()
    results: dict[str, Any] = {"sequences": a.sequences, "tokens": a.tokens, "layers": a.layers,
                               "seq_mib": seq_bytes / 2**20}
    try:
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
                 logging_level=logging.WARNING, log_to_driver=False)
        ctx = connect(srv.url, srv.http_url, MODEL, layout=layout, timeout=60.0)
        src_kv = torch.empty(ctx.kv_shape(a.tokens), dtype=torch.bfloat16)

        def fresh(tag: int) -> list[list[int]]:
            nonlocal src_kv
            srv.clear()
            time.sleep(0.2)
            rng_seed = 1000 * tag
            seqs = seed(ctx, a.sequences, a.tokens, rng_seed)
            got = ctx.retrieve(seqs[0])
            assert got is not None
            src_kv = got.clone()
            return seqs

        from lmcache_kv_fast.distributed._engine import ItemEngine

        t = time.perf_counter()
        fleet = Fleet([Server(srv.url, srv.http_url, name="srv")], MODEL,
                      connect_kwargs={"layout": layout, "timeout": 60.0},
                      max_in_flight=a.max_in_flight)
        results["fleet_start_s"] = time.perf_counter() - t
        engine = ItemEngine(ctx, max_in_flight=a.max_in_flight)

        def run_local(seqs: list[list[int]]) -> Any:
            rep = batch.rewrite(ctx, seqs, drop_every_kth, progress=False,
                                max_in_flight=a.max_in_flight)
            assert rep.ok == a.sequences, rep.summary()
            return rep

        def run_engine(seqs: list[list[int]]) -> Any:
            outs = engine.run("rewrite", list(enumerate(seqs)), fn=drop_every_kth)
            assert all(o.status == "ok" for o in outs), outs
            return None

        driver_cpu: list[float] = []

        def run_fleet(route: Any) -> Any:
            def run(seqs: list[list[int]]) -> Any:
                cpu = time.process_time()
                rep = fleet.rewrite(seqs, drop_every_kth, route=route, progress=False)
                driver_cpu.append((time.process_time() - cpu) / len(seqs))
                assert rep.ok == a.sequences, rep.summary()
                return rep
            return run

        variants = {"local": run_local, "local-engine": run_engine,
                    "ray": run_fleet(lambda _t: 0), "ray+lookup": run_fleet("lookup")}
        runs: dict[str, list[float]] = {k: [] for k in variants}
        reports: dict[str, Any] = {}
        tag = 0
        try:
            for _ in range(a.warmup):  # untimed: the server's L1 pages, each process's
                for warm in (run_engine, variants["ray"]):  # mapping of them, the pools
                    tag += 1
                    warm(fresh(tag))
            driver_cpu.clear()
            for _ in range(a.reps):  # interleaved: the box's load drifts
                for name, run in variants.items():
                    tag += 1
                    seqs = fresh(tag)
                    t = time.perf_counter()
                    rep = run(seqs)
                    runs[name].append(time.perf_counter() - t)
                    check(ctx, seqs, lambda _t: src_kv)
                    if rep is not None:
                        reports[name] = rep
            engine.close()
            srv.clear()
            # constants of the throughput model
            actor = fleet.actor("srv")
            ray.get(actor.lookup_many.remote([]))
            rtt = timed(lambda: ray.get(actor.lookup_many.remote([])), 50)
            results["ray_call_rtt_ms"] = statistics.median(rtt) * 1e3
            seqs = seed(ctx, 64, 2 * ctx.chunk_size, 777)
            via_actor = timed(lambda: fleet.lookup(seqs), 5)
            via_driver = timed(lambda: [ctx.lookup(s) for s in seqs], 5)
            results["lookup_per_seq_via_actor_ms"] = statistics.median(via_actor) / 64 * 1e3
            results["lookup_per_seq_driver_ctx_ms"] = statistics.median(via_driver) / 64 * 1e3
            long_toks = [random.randrange(0, 2**31) for _ in range(a.tokens)]
            h = timed(lambda: chunk_hashes(long_toks, ctx.chunk_size), 200)
            results["route_hash_per_seq_us"] = statistics.median(h) * 1e6
            with KVEventsIndex([Server(srv.url, srv.http_url, name="srv")], MODEL) as idx:
                b = timed(lambda: idx.best(long_toks), 200)
            results["route_index_per_seq_us"] = statistics.median(b) * 1e6
            results["driver_cpu_ms_per_item"] = statistics.median(driver_cpu) * 1e3
            # tiny items: sequences cached nowhere, sent to the actor anyway (one lookup
            # each): the per-item ceiling of the driver + Ray + one actor
            tiny = [[random.randrange(0, 2**31) for _ in range(ctx.chunk_size)] for _ in range(256)]
            for ipc in (1, 8):
                fleet.items_per_call = ipc
                cpu = time.process_time()
                t = time.perf_counter()
                rep = fleet.rewrite(tiny, drop_every_kth, route=lambda _t: 0, progress=False)
                wall = time.perf_counter() - t
                assert rep.missed == len(tiny), rep.summary()
                results[f"tiny_items_per_s_ipc{ipc}"] = len(tiny) / wall
                results[f"tiny_driver_cpu_ms_per_item_ipc{ipc}"] = (
                    (time.process_time() - cpu) / len(tiny) * 1e3)
            fleet.items_per_call = 1
        finally:
            fleet.close()
        ctx.close()
    finally:
        ray.shutdown()
        srv.stop()

    n = a.sequences
    moved = reports["local"].bytes_moved
    print(f"W3-like rewrite: {n} x {a.tokens} tokens, [2, {a.layers}, T, 1024] bf16 "
          f"({results['seq_mib']:.0f} MiB/sequence), {a.reps} run(s) each, median:")
    print(f"{'variant':<12} {'seconds':>8} {'ms/item':>8} {'GB/s':>6} {'x local':>8} "
          f"{'+ms/item vs local':>18} {'+ms/item vs engine':>19}")
    base = statistics.median(runs["local"])
    eng = statistics.median(runs["local-engine"])
    for name, ts in runs.items():
        m = statistics.median(ts)
        results[f"{name}_s"] = m
        results[f"{name}_ms_per_item"] = m / n * 1e3
        results[f"{name}_overhead_vs_local_ms_per_item"] = (m - base) / n * 1e3
        results[f"{name}_overhead_vs_engine_ms_per_item"] = (m - eng) / n * 1e3
        print(f"{name:<12} {m:8.3f} {m / n * 1e3:8.1f} {moved / m / 1e9:6.2f} {m / base:8.3f} "
              f"{(m - base) / n * 1e3:18.1f} {(m - eng) / n * 1e3:19.1f}")
    print("  (runs: " + "; ".join(f"{k} " + " ".join(f"{t:.2f}" for t in v)
                                  for k, v in runs.items()) + ")")
    for name, rep in reports.items():
        st = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(rep.stage_seconds.items()))
        print(f"  {name} stages (summed over items): {st}")
    print(f"fleet start (1 actor): {results['fleet_start_s']:.2f} s")
    print(f"Ray round trip of an empty actor call: {results['ray_call_rtt_ms']:.2f} ms")
    print(f"lookup per sequence: via the actor (one call for 64) "
          f"{results['lookup_per_seq_via_actor_ms']:.3f} ms, from the driver's own context "
          f"{results['lookup_per_seq_driver_ctx_ms']:.3f} ms")
    print(f"driver routing per {a.tokens}-token sequence: chunk hashes "
          f"{results['route_hash_per_seq_us']:.0f} us, events-index best() "
          f"{results['route_index_per_seq_us']:.0f} us")
    print(f"driver CPU per item (W3 fleet runs): {results['driver_cpu_ms_per_item']:.2f} ms")
    for ipc in (1, 8):
        print(f"tiny items (a miss each, one actor, items_per_call={ipc}): "
              f"{results[f'tiny_items_per_s_ipc{ipc}']:.0f} items/s, driver CPU "
              f"{results[f'tiny_driver_cpu_ms_per_item_ipc{ipc}']:.2f} ms/item")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**results, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
