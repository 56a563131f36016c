"""The batched stream's modify on a CPU engine's rows, without the engine: W6's SDK side.

W6 (``bench --w6``) needs a vLLM engine (a minute to start, 15 s per prefill) and its
numbers move with the engine's busy-polling. This runs the same modify — 16 streams of
2,048 tokens in a CPU engine's ``vec`` rows (16 layers x 8 KV heads x 64, block 128,
chunk 256: Llama-3.2-1B's geometry), ``edits.drop_every(10)`` slot to slot — against a
local real server whose engine-driven context is registered as the engine's connector
does, the KV stored by this SDK instead of a prefill. Per rep (fresh tokens each): the
modify's wall time, this process's CPU (user + sys), the copy kernel's CPU on the calling
threads (all of it with one copy thread), the server's CPU, and a flat memcpy of the
batch's bytes timed in the same rep (the roofline of one pass). With ``--spin`` a process
spins on ``sched_yield`` during the modify. ``--one-core CPU`` runs this process and its
server on one CPU with one copy thread: W6's condition, where the engine's worker
busy-polls the other core for 1 s after its last step (docs/performance.md). No assertions.

    .venv/bin/python -m benches.bench_modify_rows [--reps 5] [--streams 16] [--spin]
        [--one-core 1]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import lmcache_kv_fast  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lmcache_kv_fast.sdk as sdk
from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven
from lmcache_kv_fast.testing.server import LMCacheServer

MiB = 1 << 20


def llama_config(layers: int, heads: int, head_dim: int) -> dict[str, Any]:
    """A Llama ``config.json`` with the given KV geometry (bfloat16)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 512, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_dim": head_dim, "torch_dtype": "bfloat16", "vocab_size": 1024,
            "rope_theta": 500000.0, "max_position_embeddings": 131072}


def _group_cpu(pid: int) -> float:
    """user + sys seconds of ``pid`` and its threads (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spin(stop: Any) -> None:
    while not stop.is_set():
        os.sched_yield()


@contextlib.contextmanager
def spinner(on: bool) -> Iterator[None]:
    """A process spinning on ``sched_yield`` (the engine's busy-poll) while the block runs."""
    if not on:
        yield
        return
    stop = mp.get_context("fork").Event()
    p = mp.get_context("fork").Process(target=_spin, args=(stop,), daemon=True)
    p.start()
    try:
        time.sleep(0.05)
        yield
    finally:
        stop.set()
        p.join(5)


def quiesce(pid: int, limit_s: float = 10.0) -> None:
    """Wait until the server's CPU stays idle for 0.2 s (its work on the seeding stores)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        c0 = _group_cpu(pid)
        time.sleep(0.2)
        if _group_cpu(pid) - c0 < 0.01:
            return


@contextlib.contextmanager
def perf_window() -> Iterator[None]:
    """Enable ``perf record --control fifo:CTL,ACK -D -1`` while the block runs.

    ``BENCH_PERF_CTL=CTL,ACK`` names the fifos (unset: nothing is done), so a profile
    holds the modify alone, not the seeding stores.
    """
    spec = os.environ.get("BENCH_PERF_CTL")
    if not spec:
        yield
        return
    ctl, ack = spec.split(",")

    def say(cmd: str) -> None:
        with open(ctl, "w") as f:
            f.write(cmd + "\n")
        with open(ack) as f:
            f.readline()

    say("enable")
    try:
        yield
    finally:
        say("disable")


class KernelClock:
    """CPU seconds spent in ``_native.fused_blocks`` on the threads that call it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._inner = _native.fused_blocks

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return self._inner(*args, **kwargs)
        finally:
            dt = time.thread_time() - t
            with self._lock:
                self.seconds += dt

    @contextlib.contextmanager
    def installed(self) -> Iterator[KernelClock]:
        """Time every ``fused_blocks`` call while the block runs."""
        _native.fused_blocks = self  # type: ignore[assignment]
        try:
            yield self
        finally:
            _native.fused_blocks = self._inner  # type: ignore[assignment]


def pin_one_core(cpu: int) -> None:
    """Run this process (and the server it starts) on ``cpu`` with one copy thread."""
    os.sched_setaffinity(0, {cpu})
    _native.set_threads(1)


def memcpy_s(nbytes: int) -> float:
    """Seconds of one flat memcpy of ``nbytes`` between pre-faulted buffers."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    _native.memcpy(b.data_ptr(), a.data_ptr(), nbytes)
    t = time.perf_counter()
    _native.memcpy(b.data_ptr(), a.data_ptr(), nbytes)
    return time.perf_counter() - t


def one_rep(ctx: Any, args: argparse.Namespace, rep: int, srv: LMCacheServer) -> dict[str, Any]:
    """Empty the server's cache, store fresh streams, then time one batched modify of them."""
    srv.clear()
    server_pid = srv.proc.pid
    gen = torch.Generator().manual_seed(rep)
    width = args.heads * args.head_dim
    batch = sdk.batch.LMCacheBatchedStream(progress=False, **(
        {"max_in_flight": args.in_flight} if args.in_flight else {}))
    kv = torch.randn(2, args.layers, args.tokens, width, generator=gen).to(torch.bfloat16)
    for i in range(args.streams):
        toks = [(rep * 7919 + i * 104729 + k * 31) % (1 << 30) + 1 for k in range(args.tokens)]
        if not ctx.kv_context.store(kv, toks):
            raise RuntimeError("seeding store failed")
        s = sdk.request.create_request([ctx], lambda *a: iter(()), toks)
        s._stored_upto = len(toks)  # as after the engine's prefill of these tokens
        batch.add(s)
    del kv
    nbytes = args.streams * 2 * args.layers * args.tokens * width * 2
    copy = memcpy_s(nbytes)
    quiesce(server_pid)
    fn = edits.drop_every(10)
    with spinner(args.spin), perf_window(), KernelClock().installed() as kernel:
        srv0, ru0 = _group_cpu(server_pid), resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        report = batch.modify(fn)
        wall = time.perf_counter() - t
        ru1, srv1 = resource.getrusage(resource.RUSAGE_SELF), _group_cpu(server_pid)
    fused = sum(getattr(m, "path", "") == "fused" for m in batch.last_modify.items)
    stages = report.to_dict()["metrics"]["stages"]
    return {"wall": wall, "user": ru1.ru_utime - ru0.ru_utime,
            "sys": ru1.ru_stime - ru0.ru_stime, "kernel": kernel.seconds,
            "server": srv1 - srv0, "memcpy": copy,
            "fused": fused, "faults": ru1.ru_minflt - ru0.ru_minflt, "stages": stages}


def run(args: argparse.Namespace) -> None:
    """Start a server, register the engine's context, run the reps, print the table."""
    gib = args.streams * args.tokens * 2 * args.layers * args.heads * args.head_dim * 2 / 2**30
    with LMCacheServer(l1_size_gb=max(2.0, 2.5 * gib)) as srv:
        srv.warm_pool()
        name = f"bench-modify-rows-{os.getpid()}"
        iid = register_engine_driven(srv.url, name, block_size=128, use_mla=True,
                                     num_layers=args.layers,
                                     hidden=args.heads * 2 * args.head_dim)
        try:
            cfg = llama_config(args.layers, args.heads, args.head_dim)
            with sdk.connect(sdk.LMCacheSDKCacheKind.KV, srv.url, srv.http_url, name,
                             model_config=cfg, kernel=args.kernel) as ctx:
                rows = [one_rep(ctx, args, rep, srv) for rep in range(args.reps)]
        finally:
            unregister_engine_driven(srv.url, iid)
    print(f"modify of {args.streams} x {args.tokens} tokens ({gib:.2f} GiB), "
          f"geometry {args.layers},{args.heads},{args.head_dim}, kernel {args.kernel}, "
          f"spinner {'on' if args.spin else 'off'}, CPUs {sorted(os.sched_getaffinity(0))}, "
          f"{_native.get_threads()} copy thread(s)")
    print("| rep | wall s | SDK user s | SDK sys s | kernel s | server s | memcpy s | "
          "wall/memcpy | faults | fused |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['wall']:.3f} | {r['user']:.3f} | {r['sys']:.3f} | "
              f"{r['kernel']:.3f} | {r['server']:.3f} | {r['memcpy']:.3f} | "
              f"{r['wall'] / r['memcpy']:.2f} | {r['faults']} | {r['fused']} |")
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("wall", "user", "sys", "kernel", "server", "memcpy")}
    print(f"| median | {med['wall']:.3f} | {med['user']:.3f} | {med['sys']:.3f} | "
          f"{med['kernel']:.3f} | {med['server']:.3f} | {med['memcpy']:.3f} | "
          f"{med['wall'] / med['memcpy']:.2f} | | |")
    print("stages (last rep, summed over streams):",
          {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1]["stages"].items()})


def main() -> None:
    """Parse the arguments and run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernel", default="vec", choices=["vec", "vec16", "amx"])
    p.add_argument("--in-flight", type=int, default=0, help="max streams in flight (0: default)")
    p.add_argument("--spin", action="store_true", help="a sched_yield spinner meanwhile")
    p.add_argument("--one-core", type=int, metavar="CPU", default=None,
                   help="this process and its server on one CPU, one copy thread (W6's case)")
    args = p.parse_args()
    if args.one_core is not None:
        pin_one_core(args.one_core)
    run(args)


if __name__ == "__main__":
    main()
