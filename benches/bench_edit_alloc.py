"""Why a plain edit is slow, and what fixes it: the edit alone, no server.

Not part of CI. Calls the plain edit (``kv.index_select(2, torch.tensor(keep))`` on a
``[2, L, T, 1024]`` bf16 KV, a fresh output every call) ``--calls`` times per variant and
prints per variant the median [range] ms per call, minor page faults per call, and how
much glibc's heap grew (``mallinfo2``: arena + mmapped bytes) — each variant in a fresh
interpreter (glibc settings cannot be undone reliably):

* ``plain``: glibc defaults (outputs above 32 MiB are mapped afresh and unmapped on free);
* ``mallopt``: ``M_MMAP_THRESHOLD`` 1 GiB + ``M_TRIM_THRESHOLD`` 2 GiB (keep freed blocks);
* ``mallopt-nommap``: ``M_MMAP_MAX`` 0 + ``M_TRIM_THRESHOLD`` 2 GiB;
* ``pooled``: :class:`lmcache_kv_fast.batch._policy.PooledOutputs` (warm result pool);

each on the main thread and on a fresh worker thread, with ``--threads`` torch intra-op
threads (the OpenMP count of the calling thread), and optionally ``--busy N`` threads
spinning on memory copies meanwhile (the copies of a pipelined batch):

    .venv/bin/python benches/bench_edit_alloc.py --threads 1,2 --busy 0,1
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

VARIANTS = ("plain", "mallopt", "mallopt-nommap", "pooled")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_bytes(libc: Any) -> int:
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    return int(mi.arena + mi.hblkhd)


def child(variant: str, where: str, threads: int, busy: int, calls: int, layers: int,
          tokens: int) -> dict[str, Any]:
    """One variant in this interpreter; returns its measurements."""
    import torch

    libc = ctypes.CDLL("libc.so.6")
    accepted: list[int] = []
    if variant == "mallopt":
        accepted += [libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(1 << 30)),
                     libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))]
    elif variant == "mallopt-nommap":
        accepted += [libc.mallopt(M_MMAP_MAX, ctypes.c_int(0)),
                     libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))]
    kv = torch.empty((2, layers, tokens, 1024), dtype=torch.bfloat16)
    kv.view(torch.int16).random_(0, 16000)
    toks = list(range(tokens))
    mode = None
    if variant == "pooled":
        from lmcache_kv_fast.batch._policy import PooledOutputs
        from lmcache_kv_fast.copy.select import backend

        mode = PooledOutputs(backend().alloc_result)

    def edit(kv: Any, tokens: list[int]) -> Any:
        keep = [i for i in range(len(tokens)) if i % 10 != 9]
        return kv.index_select(2, torch.tensor(keep)), [tokens[i] for i in keep]

    stop = threading.Event()

    def spin() -> None:  # a copy thread of a neighbouring sequence
        a = torch.empty(64 << 20, dtype=torch.uint8)
        b = torch.empty_like(a)
        a.fill_(1)
        b.fill_(2)
        while not stop.is_set():
            b.copy_(a)

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    out: dict[str, Any] = {}

    def run() -> None:
        from lmcache_kv_fast.batch._policy import set_thread_intraop_threads

        set_thread_intraop_threads(threads)
        ms, faults = [], []
        heap0 = _heap_bytes(libc)
        for _ in range(calls):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            if mode is not None:
                with mode:
                    r, _ = edit(kv, toks)
            else:
                r, _ = edit(kv, toks)
            ms.append((time.perf_counter() - t0) * 1e3)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            del r
        out.update(ms=ms, faults=faults, heap_growth=_heap_bytes(libc) - heap0,
                   accepted=accepted, threads=torch.get_num_threads())

    for s in spinners:
        s.start()
    try:
        if where == "main":
            run()
        else:
            t = threading.Thread(target=run)
            t.start()
            t.join()
    finally:
        stop.set()
        for s in spinners:
            s.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--where", default="main,worker")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--busy", default="0")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print("@@" + json.dumps(child(**spec)), flush=True)
        return 0
    out_mib = 2 * args.layers * (args.tokens - args.tokens // 10) * 1024 * 2 / 2**20
    print(f"edit: index_select of [2, {args.layers}, {args.tokens}, 1024] bf16 -> "
          f"{out_mib:.0f} MiB output, {args.calls} calls per variant")
    print(f"{'variant':16} {'thread':7} {'omp':>3} {'busy':>4} {'ms/call median [range]':>26} "
          f"{'faults/call':>11} {'heap growth MiB':>15}  mallopt ok")
    for busy in (int(x) for x in args.busy.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            for where in args.where.split(","):
                for variant in args.variants.split(","):
                    spec = {"variant": variant, "where": where, "threads": threads,
                            "busy": busy, "calls": args.calls, "layers": args.layers,
                            "tokens": args.tokens}
                    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                                       capture_output=True, text=True, check=False)
                    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("@@")), "")
                    if not line:
                        print(f"{variant:16} {where:7} failed: {p.stderr.strip()[-300:]}")
                        continue
                    r = json.loads(line[2:])
                    ms = r["ms"][1:] or r["ms"]  # the first call also maps the pool
                    print(f"{variant:16} {where:7} {r['threads']:3d} {busy:4d} "
                          f"{statistics.median(ms):9.0f} [{min(ms):.0f}-{max(ms):.0f}]".ljust(54)
                          + f"{statistics.median(r['faults'][1:] or r['faults']):11.0f} "
                          f"{r['heap_growth'] / 2**20:15.0f}  {r['accepted'] or '-'}",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
