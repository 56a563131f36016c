"""Time each library edit on one sequence, inside ``PooledOutputs`` as ``batch.rewrite`` runs it.

For every edit of ``lmcache_kv_fast.edits`` (with ``rope=`` Llama-3.2-1B's llama3 RoPE)
on one sequence of ``--tokens`` tokens, at Llama-3.2-1B's KV geometry (16 layers x 8 KV
heads x 64, bf16; bench W6's default) and at W3P's ``[2, 32, T, 1024]`` bf16 (16 KV heads
of 64 here, the RoPE's head size): the median time over ``--reps`` warm calls and the
minor page faults per call (0 when every large output comes from the warm result pool).
Each call runs on one thread set up like ``batch.rewrite``'s edit thread (its own
intra-op thread count, ``--threads``). Also W7's plain-torch SnapKV + re-rotation (what
upstream's loop applies) without the pool, and a warm ``memcpy`` of the sequence's bytes,
as a yardstick of a retrieve's copy.

    PYTHONPATH=. .venv/bin/python -m benches.bench_edits [--reps 5] [--threads 2] [--only rkv]
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benches.harness.edits import LLAMA32_1B_ROPE, llama3_inv_freq, snapkv_rerotate_plain
from lmcache_kv_fast import edits
from lmcache_kv_fast.batch._policy import PooledOutputs, set_thread_intraop_threads
from lmcache_kv_fast.copy.select import backend

logger = logging.getLogger("bench_edits")

#: Llama-3.2-1B's ``config.json`` RoPE (and head size).
LLAMA32_1B = {"model_type": "llama", "head_dim": 64, "hidden_size": 2048,
              "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
              "rope_theta": 500000.0}
#: ``(name, layers, kv_heads, query_heads)`` at head size 64.
GEOMETRIES = (("llama-3.2-1b [2,16,T,512]", 16, 8, 32), ("w3p [2,32,T,1024]", 32, 16, 32))


def library_edits(queries: torch.Tensor, rope: edits.RoPE) -> dict[str, Callable[..., Any]]:
    """The edits measured, by name (about half the tokens kept where a ratio is taken)."""
    return {
        "drop_every(10)": edits.drop_every(10, rope=rope),
        "keep_ratio(0.5, uniform)": edits.keep_ratio(0.5, "uniform", rope=rope),
        "streaming_llm(4, 1020)": edits.streaming_llm(4, 1020, rope=rope),
        "key_norm(0.5, keydiff)": edits.key_norm(0.5, rope=rope),
        "key_norm(0.5, l2)": edits.key_norm(0.5, method="l2", rope=rope),
        "snapkv(q, 32, 7, 0.5)": edits.snapkv(queries, 32, 7, ratio=0.5, rope=rope),
        "rkv(q, 8, 7, 0.5)": edits.rkv(queries, 8, 7, ratio=0.5, rope=rope),
        "W7 plain torch snapkv+rope (no pool)": _plain_snapkv(queries),
    }


def _plain_snapkv(queries: torch.Tensor) -> Callable[..., Any]:
    """W7's upstream-loop edit (plain torch, fresh outputs): not run under the pool."""
    inv_freq = llama3_inv_freq(LLAMA32_1B_ROPE)

    def fn(kv: torch.Tensor, tokens: list[int]) -> Any:
        return snapkv_rerotate_plain(kv, tokens, queries, inv_freq)

    fn.plain = True  # type: ignore[attr-defined]
    return fn


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _call(fn: Callable[..., Any], kv: torch.Tensor, tokens: list[int], pooled: bool
          ) -> tuple[float, int]:
    """Seconds and minor faults of one call (process-wide faults: nothing else runs)."""
    f0 = _faults()
    t0 = time.perf_counter()
    if pooled:
        with PooledOutputs(backend().alloc_result):
            out = fn(kv, tokens)
    else:
        out = fn(kv, tokens)
    dt = time.perf_counter() - t0
    del out
    return dt, _faults() - f0


def time_edit(pool: ThreadPoolExecutor, fn: Callable[..., Any], kv: torch.Tensor,
              tokens: list[int], reps: int, pooled: bool) -> tuple[float, float]:
    """Median seconds and minor faults per call of ``fn(kv, tokens)`` (one warm-up call)."""
    runs = [pool.submit(_call, fn, kv, tokens, pooled).result() for _ in range(reps + 1)]
    return statistics.median(r[0] for r in runs[1:]), statistics.median(r[1] for r in runs[1:])


def memcpy_s(kv: torch.Tensor, reps: int) -> float:
    """Median seconds of a warm copy of ``kv``'s bytes (a retrieve's copy, no server)."""
    dst = torch.empty_like(kv)
    dst.copy_(kv)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(kv)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def window_floor(kv: torch.Tensor, q: torch.Tensor, reps: int) -> tuple[float, float, float]:
    """SnapKV's unavoidable work alone: median seconds of its window scores and their exps.

    The scores are every window query against every key, ``q @ k^T`` per KV head group
    (``L * H_q * window * T * head_dim`` multiply-adds), as one torch bf16 batched matmul
    (oneDNN, fp32 accumulation); then one fp32 ``exp`` over the scores (the softmax's).
    Returns ``(matmul s, exp s, multiply-adds)``: no implementation of the edit can be
    faster than their sum on this machine.
    """
    layers, tokens, width = kv.shape[1], kv.shape[2], kv.shape[3]
    hd = 64
    kvh = width // hd
    group = q.shape[2] // hd // kvh
    qg = q.view(layers, q.shape[1], kvh, group, hd).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(layers * kvh, group * q.shape[1], hd).contiguous()
    k = kv[0].view(layers, tokens, kvh, hd).permute(0, 2, 3, 1).reshape(layers * kvh, hd, tokens)
    k = k.contiguous()
    out = torch.empty(layers * kvh, qg.shape[1], tokens, dtype=torch.bfloat16)
    scores = torch.randn(out.shape, dtype=torch.float32)
    ex = torch.empty_like(scores)

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    mm = timed(lambda: torch.bmm(qg, k, out=out))
    ex_s = timed(lambda: torch.exp(scores, out=ex))
    return mm, ex_s, float(qg.shape[0] * qg.shape[1] * hd * tokens)


def main(argv: list[str] | None = None) -> int:
    """Print one table per geometry: edit, ms, faults per call."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--only", help="comma-separated substrings of the edit names to run")
    ap.add_argument("--plain", action="store_true", help="also time without PooledOutputs")
    ap.add_argument("--floor", action="store_true",
                    help="also time SnapKV's window scores and their exps alone (its floor)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pool = ThreadPoolExecutor(1, initializer=set_thread_intraop_threads,
                              initargs=(args.threads,))
    rope = edits.rope_from_config(LLAMA32_1B)
    gen = torch.Generator().manual_seed(0)
    tokens = list(range(args.tokens))
    for name, layers, kv_heads, q_heads in GEOMETRIES:
        kv = torch.randn(2, layers, args.tokens, kv_heads * 64, generator=gen).to(torch.bfloat16)
        q = torch.randn(layers, 32, q_heads * 64, generator=gen).to(torch.bfloat16)
        logger.info("## %s, %d tokens, bf16, %d threads, backend %s; warm copy of the "
                    "sequence %.1f ms", name, args.tokens, args.threads, backend().NAME,
                    memcpy_s(kv, args.reps) * 1e3)
        if args.floor:
            mm, ex, macs = pool.submit(window_floor, kv, q, args.reps).result()
            logger.info("SnapKV's floor: window scores %.1f ms (%.2f G multiply-adds, torch bf16 "
                        "bmm: %.0f GMAC/s) + their exps %.1f ms = %.1f ms", mm * 1e3, macs / 1e9,
                        macs / mm / 1e9, ex * 1e3, (mm + ex) * 1e3)
        logger.info("| edit | pooled ms | faults/call |%s", " plain ms |" if args.plain else "")
        for label, fn in library_edits(q, rope).items():
            if args.only and not any(s in label for s in args.only.split(",")):
                continue
            plain = getattr(fn, "plain", False)
            t, f = time_edit(pool, fn, kv, tokens, args.reps, pooled=not plain)
            extra = f" {time_edit(pool, fn, kv, tokens, args.reps, False)[0] * 1e3:.1f} |" \
                if args.plain else ""
            logger.info("| %s | %.1f | %d |%s", label, t * 1e3, f, extra)
    pool.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
