"""Copy-path benchmark: native core vs torch backend vs a memcpy roofline, side by side.

Creates a 1 GiB POSIX segment in /dev/shm (unlinked at the end, even on error), then
measures, in ONE run with the cases interleaved round-robin (so drift and neighbours'
noise hit every case alike):

* populate: cost of mapping (and first write to) a segment for each pre-fault mode,
  plus mapping a 4 GiB segment (``--skip-4g`` to skip);
* threshold: one flat copy of 32 KiB..8 MiB on 1 thread vs the pool (the parallel
  threshold);
* kernel: glibc memcpy vs streaming stores for large copies;
* main table: scatter / gather of [2, 32, 4096, 1024] bf16 (0.5 GiB, 16 chunks of 256
  tokens) for native (1 thread, all threads), torch backend (torch default threads and
  torch.set_num_threads(1)) and the memcpy roofline; gather into a preallocated ``out``
  and into a new result (alloc_result variants) vs upstream-style torch.cat;
* ratios against the targets.

Run: ``python benches/bench_copy.py`` (``--reps N``, ``--quick``, ``--skip-4g``) from the
repository (the source tree is used when the package is not installed). No assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:
    import lmcache_kv_fast  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmcache_kv_fast import _native
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy import torch_backend as tb
from lmcache_kv_fast.copy.base import ChunkGeometry

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


# --------------------------------------------------------------------------- helpers


@dataclass
class Case:
    name: str
    run: Callable[[], None]
    nbytes: int
    setup: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None
    threads: str = ""
    times: list[float] = field(default_factory=list)

    def best(self) -> float:
        return min(self.times)

    def med(self) -> float:
        return statistics.median(self.times)

    def gbps_best(self) -> float:
        return self.nbytes / self.best() / 1e9

    def gbps_med(self) -> float:
        return self.nbytes / self.med() / 1e9


def run_round_robin(cases: list[Case], reps: int, warmup: int) -> None:
    for c in cases:
        for _ in range(warmup):
            c.setup()
            c.run()
            c.after()
    for _ in range(reps):
        for c in cases:
            c.setup()
            t0 = time.perf_counter()
            c.run()
            c.times.append(time.perf_counter() - t0)
            c.after()


def print_cases(title: str, cases: list[Case]) -> None:
    print(f"\n== {title}")
    print(f"{'case':52s} {'thr':>4s} {'min ms':>8s} {'med ms':>8s} "
          f"{'GB/s best':>10s} {'GB/s med':>9s}")
    for c in cases:
        print(f"{c.name:52s} {c.threads:>4s} {c.best() * 1e3:8.2f} {c.med() * 1e3:8.2f} "
              f"{c.gbps_best():10.2f} {c.gbps_med():9.2f}")


class ShmFile:
    """A /dev/shm segment created for the benchmark; unlinked by close()."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.path = f"/dev/shm/{name}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def touch_segment(name: str) -> None:
    """Allocate every page of the segment (the server's pool is resident)."""
    m = _native.Mapping(name, populate="parallel")
    m.close()


def set_native_threads(n: int) -> Callable[[], None]:
    return lambda: _native.set_threads(n)


# --------------------------------------------------------------------------- sections


def bench_populate(seg: ShmFile, reps: int, src: torch.Tensor, skip_4g: bool) -> None:
    n = src.numel()
    modes = ["none", "map_populate", "madvise", "parallel", "parallel_read", "resident"]
    open_t: dict[str, list[float]] = {m: [] for m in modes}
    first_t: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        for mode in modes:
            t0 = time.perf_counter()
            m = _native.Mapping(seg.name, populate=mode)
            t1 = time.perf_counter()
            _native.memcpy(m.address, src.data_ptr(), n)  # first write of 0.5 GiB
            t2 = time.perf_counter()
            m.close()
            open_t[mode].append(t1 - t0)
            first_t[mode].append(t2 - t1)
    print(f"\n== populate: map the 1 GiB segment (resident pages), then first write of "
          f"{n / GiB:.2f} GiB ({reps} reps, medians)")
    print(f"{'mode':14s} {'open ms':>9s} {'1st write ms':>13s} {'open+write ms':>14s}")
    tot = {}
    for mode in modes:
        o, f = statistics.median(open_t[mode]), statistics.median(first_t[mode])
        tot[mode] = o + f
        print(f"{mode:14s} {o * 1e3:9.1f} {f * 1e3:13.1f} {(o + f) * 1e3:14.1f}")
    print(f"fastest open+write: {min(tot, key=tot.__getitem__)}; fastest open only: "
          f"{min(open_t, key=lambda k: statistics.median(open_t[k]))}; "
          f"'auto' maps with: {_native.Mapping(seg.name, populate='auto').populate}")
    if skip_4g:
        return
    big = ShmFile(f"lmckv-bench4g-{os.getpid()}", 4 * GiB)
    try:
        rows = []
        t0 = time.perf_counter()
        m = _native.Mapping(big.name)  # auto: only resident pages -> nothing to populate
        rows.append((f"4 GiB, not resident, populate=auto ({m.populate})",
                     time.perf_counter() - t0))
        m.close()
        t0 = time.perf_counter()
        m = _native.Mapping(big.name, populate="parallel_read")  # allocates all 4 GiB
        rows.append(("4 GiB, not resident, populate=parallel_read (allocates it all)",
                     time.perf_counter() - t0))
        m.close()
        for mode in ["auto", "none", "map_populate", "madvise", "parallel", "parallel_read",
                     "resident"]:
            t0 = time.perf_counter()
            m = _native.Mapping(big.name, populate=mode)
            rows.append((f"4 GiB, resident, populate={mode} ({m.populate})",
                         time.perf_counter() - t0))
            m.close()
        print("\n== mapping a 4 GiB segment")
        for name, t in rows:
            print(f"{name:52s} {t * 1e3:9.1f} ms")
    finally:
        big.close()


def bench_threshold(quick: bool) -> int:
    sizes = [32 * KiB, 64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, MiB, 2 * MiB, 4 * MiB,
             8 * MiB]
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.zeros(max(sizes), dtype=torch.uint8)
    old_thr = _native.get_parallel_threshold()
    all_threads = _native.get_threads()
    _native.set_parallel_threshold(0)
    print(f"\n== threshold: one flat warm copy, 1 thread vs {all_threads} threads "
          "(median µs)")
    print(f"{'size':>8s} {'1 thr':>9s} {f'{all_threads} thr':>9s} {'speedup':>8s}")
    choose = None
    try:
        for s in sizes:
            reps = 50 if quick else max(20, min(400, (64 * MiB) // s))
            res = {}
            for th in (1, all_threads):
                _native.set_threads(th)
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    _native.memcpy(dst.data_ptr(), src.data_ptr(), s)
                    ts.append(time.perf_counter() - t0)
                res[th] = statistics.median(ts)
            sp = res[1] / res[all_threads]
            if sp > 1.15 and choose is None:
                choose = s
            elif sp <= 1.15:
                choose = None
            print(f"{s // KiB:6d}Ki {res[1] * 1e6:9.1f} {res[all_threads] * 1e6:9.1f} {sp:8.2f}")
    finally:
        _native.set_threads(all_threads)
        _native.set_parallel_threshold(old_thr)
    print(f"smallest size from which the pool wins by >15%: "
          f"{(choose or 0) // KiB} KiB; compiled default threshold: {old_thr // KiB} KiB")
    return choose or old_thr


def bench_kernels(reps: int, regions: list, x: torch.Tensor, geom: ChunkGeometry,
                  ids: list[int]) -> None:
    sizes = [512 * KiB, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 32 * MiB, 512 * MiB]
    old = _native.get_copy_kernel()
    old_pages = _native.get_stream_interleave()
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.zeros(max(sizes), dtype=torch.uint8)
    # (kernel, pages walked in lock step): glibc, linear streaming, page-interleaved streaming
    kernels = [("libc", old_pages), ("stream", 1), ("stream", 4), ("stream", old_pages)]
    if old_pages not in (1, 4):
        kernels.append(("stream", 2 * old_pages))

    def use(k: str, pages: int) -> Callable[[], None]:
        def setup() -> None:
            _native.set_copy_kernel(k)
            _native.set_stream_interleave(pages)
        return setup

    def label(k: str, pages: int) -> str:
        return "libc" if k == "libc" else f"stream/{pages}p"

    cases: list[Case] = []
    for s in sizes:
        for k, pages in kernels:
            cases.append(Case(f"memcpy {s / MiB:6.1f} MiB kernel={label(k, pages)}",
                              lambda s=s: _native.memcpy(dst.data_ptr(), src.data_ptr(), s),
                              s, setup=use(k, pages)))
    y = torch.empty_like(x)
    y.fill_(0)
    for k, pages in kernels:
        cases.append(Case(f"native scatter 0.5 GiB kernel={label(k, pages)}",
                          lambda: nb.scatter(x, geom, ids, regions), x.nbytes,
                          setup=use(k, pages)))
        cases.append(Case(f"native gather->out 0.5 GiB kernel={label(k, pages)}",
                          lambda: nb.gather(y, geom, ids, regions), x.nbytes,
                          setup=use(k, pages)))
    try:
        run_round_robin(cases, reps, 1)
    finally:
        _native.set_copy_kernel(old)
        _native.set_stream_interleave(old_pages)
    for c in cases:
        c.threads = str(_native.get_threads())
    print_cases(f"kernel: glibc memcpy vs streaming stores ({_native.config()['stream_isa']}; "
                f"stream/Np: N 4 KiB pages in lock step); auto streams from "
                f"{_native.get_stream_threshold() // MiB} MiB", cases)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="fewer reps, skip the 4 GiB map")
    ap.add_argument("--skip-4g", action="store_true")
    ap.add_argument("--main-only", action="store_true",
                    help="only the scatter/gather table and ratios")
    ap.add_argument("--kernels-only", action="store_true",
                    help="only the copy-kernel table (glibc vs streaming variants)")
    args = ap.parse_args()
    reps = 4 if args.quick else args.reps
    all_threads = _native.get_threads()
    torch_default = torch.get_num_threads()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"native config {_native.config()}, torch threads {torch_default}, "
          f"loadavg at start {os.getloadavg()[0]:.2f}")

    seg = ShmFile(f"lmckv-bench-{os.getpid()}", GiB)
    try:
        touch_segment(seg.name)
        P, L, T, D, C = 2, 32, 4096, 1024, 256
        x = torch.randn(P, L, T, D, dtype=torch.float32).to(torch.bfloat16)
        geom = ChunkGeometry(P, L, C, D, 2)
        n_chunks = T // C
        ids = list(range(n_chunks))
        nbytes = x.nbytes

        if not (args.main_only or args.kernels_only):
            bench_populate(seg, 3 if args.quick else 5, x.view(torch.uint8).reshape(-1),
                           args.skip_4g or args.quick)
            bench_threshold(args.quick)

        nseg = nb.open_segment(seg.name)
        tseg = tb.open_segment(seg.name)
        slots = [_Slot(i * geom.chunk_nbytes, geom.chunk_nbytes) for i in range(n_chunks)]
        nregs = nseg.regions(slots, geom.chunk_nbytes, 4096)
        tregs = tseg.regions(slots, geom.chunk_nbytes, 4096)

        if args.kernels_only:
            bench_kernels(reps, nregs, x, geom, ids)
            return 0
        if not args.main_only:
            bench_kernels(max(3, reps // 2), nregs, x, geom, ids)

        out = torch.empty_like(x)
        out.fill_(0)
        flat_dst = torch.empty(nbytes, dtype=torch.uint8)
        flat_dst.fill_(0)
        src_flat = x.view(torch.uint8).reshape(-1)

        def roof(th: int) -> Case:
            return Case(f"roofline memcpy {nbytes / GiB:.2f} GiB", lambda: _native.memcpy(
                flat_dst.data_ptr(), src_flat.data_ptr(), nbytes), nbytes,
                setup=set_native_threads(th), threads=str(th))

        def torch_threads(n: int) -> Callable[[], None]:
            return lambda: torch.set_num_threads(n)

        nb.scatter(x, geom, ids, nregs)  # the segment holds the chunks for the gathers
        keep: list[torch.Tensor] = []

        def drop() -> None:
            keep.clear()

        def gather_new_native() -> None:
            r = nb.alloc_result(x.shape, x.dtype)
            nb.gather(r, geom, ids, nregs)
            keep.append(r)

        def fresh_buffer(prefault: str) -> Callable[[], None]:
            def run() -> None:
                buf = _native.ResultBuffer(nbytes, prefault=prefault, pool=False)
                r = torch.frombuffer(buf, dtype=x.dtype, count=x.numel()).view(x.shape)
                nb.gather(r, geom, ids, nregs)
                keep.append(r)
            return run

        def gather_torch_empty() -> None:
            r = torch.empty(x.shape, dtype=x.dtype)
            nb.gather(r, geom, ids, nregs)
            keep.append(r)

        obj_shape = geom.object_shape()

        def upstream_cat() -> None:
            views = [r.tensor.view(x.dtype).view(obj_shape) for r in tregs]
            keep.append(torch.cat(views, dim=2))

        # Tensor-parallel shard: W = D/4 columns at col_offset = 2*W (strided rows of 512 B).
        shard = ChunkGeometry(P, L, C, D // 4, 2)
        sbase = n_chunks * geom.chunk_nbytes  # after the full-width slots
        sslots = [_Slot(sbase + i * shard.chunk_nbytes, shard.chunk_nbytes)
                  for i in range(n_chunks)]
        snregs = nseg.regions(sslots, shard.chunk_nbytes, 4096)
        stregs = tseg.regions(sslots, shard.chunk_nbytes, 4096)
        sbytes = shard.chunk_nbytes * n_chunks

        a = str(all_threads)
        cases = [
            roof(1), roof(all_threads),
            Case("native scatter", lambda: nb.scatter(x, geom, ids, nregs), nbytes,
                 setup=set_native_threads(1), threads="1"),
            Case("native scatter", lambda: nb.scatter(x, geom, ids, nregs), nbytes,
                 setup=set_native_threads(all_threads), threads=a),
            Case("torch scatter (torch default threads)",
                 lambda: tb.scatter(x, geom, ids, tregs), nbytes,
                 setup=torch_threads(torch_default), threads=str(torch_default)),
            Case("torch scatter (torch.set_num_threads(1))",
                 lambda: tb.scatter(x, geom, ids, tregs), nbytes,
                 setup=torch_threads(1), after=torch_threads(torch_default), threads="1"),
            Case("native gather->out", lambda: nb.gather(out, geom, ids, nregs), nbytes,
                 setup=set_native_threads(1), threads="1"),
            Case("native gather->out", lambda: nb.gather(out, geom, ids, nregs), nbytes,
                 setup=set_native_threads(all_threads), threads=a),
            Case("torch gather->out (torch default threads)",
                 lambda: tb.gather(out, geom, ids, tregs), nbytes,
                 setup=torch_threads(torch_default), threads=str(torch_default)),
            Case("torch gather->out (torch.set_num_threads(1))",
                 lambda: tb.gather(out, geom, ids, tregs), nbytes,
                 setup=torch_threads(1), after=torch_threads(torch_default), threads="1"),
            Case("native gather->new alloc_result (pooled)", gather_new_native, nbytes,
                 setup=set_native_threads(all_threads), after=drop, threads=a),
            Case("native gather->new hugepage mmap, no pool", fresh_buffer("none"), nbytes,
                 after=drop, threads=a),
            Case("native gather->new hugepage mmap+populate, no pool",
                 fresh_buffer("populate"), nbytes, after=drop, threads=a),
            Case("native gather->new torch.empty", gather_torch_empty, nbytes, after=drop,
                 threads=a),
            Case("upstream-style torch.cat of slot views", upstream_cat, nbytes,
                 setup=torch_threads(torch_default), after=drop, threads=str(torch_default)),
            Case("native scatter TP shard W=D/4 (0.125 GiB)",
                 lambda: nb.scatter(x, shard, ids, snregs, col_offset=2 * shard.width), sbytes,
                 setup=set_native_threads(all_threads), threads=a),
            Case("torch scatter TP shard W=D/4 (0.125 GiB)",
                 lambda: tb.scatter(x, shard, ids, stregs, col_offset=2 * shard.width), sbytes,
                 setup=torch_threads(torch_default), threads=str(torch_default)),
            Case("native gather->out TP shard W=D/4 (0.125 GiB)",
                 lambda: nb.gather(out, shard, ids, snregs, col_offset=2 * shard.width), sbytes,
                 setup=set_native_threads(all_threads), threads=a),
            Case("torch gather->out TP shard W=D/4 (0.125 GiB)",
                 lambda: tb.gather(out, shard, ids, stregs, col_offset=2 * shard.width), sbytes,
                 setup=torch_threads(torch_default), threads=str(torch_default)),
        ]
        # Sanity: the gathers reproduce x.
        nb.gather(out, geom, ids, nregs)
        assert_equal = torch.equal(out, x)
        run_round_robin(cases, reps, 2)
        _native.set_threads(all_threads)
        torch.set_num_threads(torch_default)
        print_cases(f"scatter/gather [{P}, {L}, {T}, {D}] bf16 = {nbytes / GiB:.2f} GiB, "
                    f"{n_chunks} chunks of {C} tokens, {reps} reps round-robin "
                    f"(gather result check: {'ok' if assert_equal else 'MISMATCH'})", cases)

        by = {(c.name, c.threads): c for c in cases}

        def ratio(label: str, num: Case, den: Case, target: float) -> None:
            rb = num.gbps_best() / den.gbps_best()
            rm = num.gbps_med() / den.gbps_med()
            flag = "ok" if rm >= target else ("ok (best)" if rb >= target else "BELOW")
            print(f"{label:58s} best {rb:5.2f}  med {rm:5.2f}  target >= {target:<4} {flag}")

        roof_all = by[("roofline memcpy 0.50 GiB", a)]
        ns, ng = by[("native scatter", a)], by[("native gather->out", a)]
        print("\n== ratios (GB/s over GB/s)")
        ratio("native scatter (all threads) / roofline", ns, roof_all, 0.85)
        ratio("native scatter (1 thread) / roofline (1 thread)", by[("native scatter", "1")],
              by[("roofline memcpy 0.50 GiB", "1")], 0.85)
        ratio("native gather->out (all threads) / roofline", ng, roof_all, 0.80)
        ratio("native scatter / torch scatter (torch default threads)", ns,
              by[("torch scatter (torch default threads)", str(torch_default))], 1.0)
        ratio("native gather->out / torch gather->out (default threads)", ng,
              by[("torch gather->out (torch default threads)", str(torch_default))], 1.0)
        ratio("native scatter / torch scatter at torch.set_num_threads(1)", ns,
              by[("torch scatter (torch.set_num_threads(1))", "1")], 1.5)
        ratio("native gather->out / torch gather at torch.set_num_threads(1)", ng,
              by[("torch gather->out (torch.set_num_threads(1))", "1")], 1.5)
        up = by[("upstream-style torch.cat of slot views", str(torch_default))]
        ratio("gather->new alloc_result (pooled) / upstream torch.cat",
              by[("native gather->new alloc_result (pooled)", a)], up, 2.5)
        ratio("native / torch scatter, TP shard (default threads)",
              by[("native scatter TP shard W=D/4 (0.125 GiB)", a)],
              by[("torch scatter TP shard W=D/4 (0.125 GiB)", str(torch_default))], 1.0)
        ratio("native / torch gather->out, TP shard (default threads)",
              by[("native gather->out TP shard W=D/4 (0.125 GiB)", a)],
              by[("torch gather->out TP shard W=D/4 (0.125 GiB)", str(torch_default))], 1.0)
        ratio("gather->new fresh buffer (pool miss path) / upstream torch.cat",
              by[("native gather->new hugepage mmap+populate, no pool", a)], up, 2.5)
        print(f"result pool: {_native.result_pool_stats()}; loadavg at end "
              f"{os.getloadavg()[0]:.2f}")
        keep.clear()
        nseg.close()
        tseg.close()
    finally:
        seg.close()
    return 0


@dataclass(frozen=True)
class _Slot:
    offset: int
    length: int


if __name__ == "__main__":
    raise SystemExit(main())
