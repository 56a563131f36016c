"""What per-token K/V of a CPU engine costs against moving the engine's rows as they are.

One context against a local real server (SHM plane) on a model registered the way a CPU
vLLM engine registers (engine-driven only; ``connect()`` resolves it from the model's
configuration, given here as a dict). Per rep, in rotating order, with a reused ``out``
(no allocation): ``retrieve(raw=True)`` (the native gather of the engine's rows, a flat
copy) and ``retrieve()`` (per-token: each chunk converted straight out of its slot);
``store(raw=True)`` and ``store()`` (per-token: converted straight into the slots); and the
converter alone (``CpuEngineKV.to_tokens`` / ``to_raw`` between two tensors) and a flat
memcpy of the same bytes. Prints medians and the per-token / raw ratios.

    python benches/bench_engine_convert.py [--layers 32] [--kv-heads 8] [--head-dim 128]
        [--tokens 2048] [--reps 7]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch

import lmcache_kv_fast as lkf
from lmcache_kv_fast import _native
from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven
from lmcache_kv_fast.testing.server import LMCacheServer

logger = logging.getLogger("bench_engine_convert")


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kernel", default="vec")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    nh, hs, lay, t = args.kv_heads, args.head_dim, args.layers, args.tokens
    cfg = {"num_hidden_layers": lay, "num_attention_heads": nh, "num_key_value_heads": nh,
           "head_dim": hs, "hidden_size": nh * hs, "torch_dtype": "bfloat16"}
    nbytes = 2 * lay * t * nh * hs * 2
    l1 = max(1.0, round(8 * nbytes / 2**30 + 0.5))
    with LMCacheServer(shm=True, l1_size_gb=l1) as srv:
        iid = register_engine_driven(srv.url, "bench/cpu-engine", block_size=args.block_size,
                                     use_mla=True, num_layers=lay, hidden=nh * 2 * hs)
        try:
            with lkf.connect(srv.url, srv.http_url, "bench/cpu-engine", model_config=cfg,
                             kernel=args.kernel, timeout=60) as ctx:
                return _run(ctx, args, nbytes)
        finally:
            unregister_engine_driven(srv.url, iid)


def _run(ctx: lkf.LMCacheKVCacheContext, args: argparse.Namespace, nbytes: int) -> int:
    cpu = ctx.engine_kv
    assert cpu is not None
    t = args.tokens
    toks = list(range(1, t + 1))
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(ctx.kv_shape(t), generator=g).to(ctx.dtype)
    raw = cpu.to_raw(kv)
    out_tok, out_raw = torch.empty_like(kv), torch.empty_like(raw)
    flat_dst = torch.empty_like(raw)
    for x in (out_tok, out_raw, flat_dst):
        x.zero_()
    toks2 = [x + t for x in toks]
    assert ctx.store(kv, toks)

    def clear_then(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            ctx.clear()
            return fn()
        return run

    cases: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
        "retrieve raw (rows)": (lambda: ctx.retrieve(toks, out=out_raw, raw=True), None),
        "retrieve per-token": (lambda: ctx.retrieve(toks, out=out_tok), None),
        "store raw (rows)": (lambda: ctx.store(raw, toks2, raw=True), lambda: ctx.clear()),
        "store per-token": (lambda: ctx.store(kv, toks2), lambda: ctx.clear()),
        "to_tokens alone": (lambda: cpu.to_tokens(raw, out=out_tok), None),
        "to_raw alone": (lambda: cpu.to_raw(kv, out=out_raw), None),
        "memcpy (roofline)": (lambda: _native.memcpy(flat_dst.data_ptr(), raw.data_ptr(),
                                                     nbytes) or True, None),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for rep in range(args.reps + 1):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            fn, before = cases[name]
            if before is not None:
                before()
                if name.startswith("store"):
                    assert ctx.store(kv, toks)  # the retrieve cases read this
            t0 = time.perf_counter()
            r = fn()
            dt = time.perf_counter() - t0
            if r is None or r is False:
                raise RuntimeError(f"{name} failed")
            if rep:
                samples[name].append(dt)
    assert torch.equal(ctx.retrieve(toks, out=out_tok), kv)
    assert torch.equal(ctx.retrieve(toks, out=out_raw, raw=True), raw)
    print(f"{cpu.describe()}; {t} tokens = {nbytes / 2**20:.0f} MiB; {args.reps} reps, "
          f"copy threads {_native.get_threads()}, torch threads {torch.get_num_threads()}")
    med = {k: statistics.median(v) for k, v in samples.items()}
    for k, v in med.items():
        print(f"  {k:<22} {v * 1e3:8.1f} ms  {nbytes / v / 1e9:6.2f} GB/s")
    print(f"  retrieve per-token / raw: x{med['retrieve per-token'] / med['retrieve raw (rows)']:.2f}"
          f"; store per-token / raw: x{med['store per-token'] / med['store raw (rows)']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
