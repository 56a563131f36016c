"""Fused token gathers against a flat memcpy of the same bytes (no server).

Times, in ONE run with the cases interleaved round-robin (so drift and neighbours' noise
hit every case alike), a drop-every-10th selection (``edits.drop_every(10)``, optionally
re-rotated) of ``--sources`` chunk objects into the whole output chunks:

* ``fused_blocks`` on a CPU engine's raw chunk objects ``[L, C, NH*2*HS]`` in the ``vec``
  order (K ``[HS, BS]`` per block and head: consecutive tokens), with its lane fast path
  (AVX-512) and forced onto the portable path, and in the ``amx`` order;
* ``fused_rows`` on the SDK's per-token chunk objects ``[2, L, C, NH*HS]``;
* ``memcpy``: ``_native.memcpy`` of the sources' bytes between pre-faulted buffers, the
  roofline every ratio is taken against.

Default geometry: 16 layers x 8 kv heads x head 64, block 128, chunk 256, 8 source chunks,
bfloat16, 2 copy threads (W6's). Run from the checkout root: ``.venv/bin/python -m
benches.bench_fused_copy`` (``--reps N``, ``--quick``). No assertions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:
    import lmcache_kv_fast  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benches.bench_copy import run_round_robin
from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy.base import ChunkGeometry, Region
from lmcache_kv_fast.copy.edit_kernels import Rotation
from lmcache_kv_fast.layout import CpuEngineKV

MiB = 1 << 20


@dataclass
class Case:
    """One timed call, with untimed setup / after hooks (e.g. forcing a path)."""

    name: str
    run: Callable[[], None]
    setup: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None
    times: list[float] = field(default_factory=list)

    def med(self) -> float:
        """Median seconds."""
        return statistics.median(self.times)


@dataclass(frozen=True)
class Geometry:
    """The benchmark's model and chunk geometry."""

    layers: int = 16
    heads: int = 8
    head_dim: int = 64
    block_size: int = 128
    chunk: int = 256
    sources: int = 8
    dtype: torch.dtype = torch.bfloat16

    @property
    def raw(self) -> ChunkGeometry:
        """A CPU engine's raw chunk object: one plane, W = NH * 2 * HS."""
        return ChunkGeometry(1, self.layers, self.chunk, self.heads * 2 * self.head_dim,
                             self.dtype.itemsize)

    @property
    def tokens(self) -> ChunkGeometry:
        """The SDK's per-token chunk object: K and V planes, W = NH * HS."""
        return ChunkGeometry(2, self.layers, self.chunk, self.heads * self.head_dim,
                             self.dtype.itemsize)

    def engine(self, kernel: str) -> CpuEngineKV:
        """The CPU engine whose in-block order is ``kernel``."""
        return CpuEngineKV(self.layers, self.heads, self.head_dim, self.dtype,
                           self.block_size, kernel)


def has_isa_switch() -> bool:
    """Whether this core can force fused_blocks' portable path (``_set_fused_blocks_isa``)."""
    return hasattr(_native, "_set_fused_blocks_isa")


def set_isa(name: str) -> Callable[[], None]:
    """A hook forcing fused_blocks' path (``auto`` / ``generic``)."""
    return lambda: _native._set_fused_blocks_isa(name)


def build_cases(g: Geometry, rope: bool) -> tuple[list[Case], int, int]:
    """The cases of one table, the source bytes and the destination bytes."""
    nbytes = g.raw.chunk_nbytes
    assert nbytes == g.tokens.chunk_nbytes
    srcs = [(torch.randn(g.raw.object_shape()) * 3).to(g.dtype) for _ in range(g.sources)]
    count = g.sources * g.chunk
    sel = edits.drop_every(10, rope=_rope(g) if rope else None)
    plan = edits.row_plan(sel, list(range(count)))
    assert plan is not None
    idx, rot = plan.index, plan.rotation
    ids = list(range(idx.numel() // g.chunk))
    dsts = [torch.zeros(g.raw.object_shape(), dtype=g.dtype) for _ in ids]
    src_r = [Region.of_tensor(s) for s in srcs]
    dst_r = [Region.of_tensor(d) for d in dsts]
    flat_src = torch.cat([s.reshape(-1).view(torch.uint8) for s in srcs])
    flat_dst = torch.zeros_like(flat_src)

    def blocks(kernel: str, r: Rotation | None) -> Callable[[], None]:
        eng = g.engine(kernel)
        return lambda: nb.fused_blocks(src_r, ids, dst_r, idx, g.raw, eng, r)

    cases = [Case("memcpy (sources' bytes)",
                  lambda: _native.memcpy(flat_dst.data_ptr(), flat_src.data_ptr(),
                                         flat_src.numel()))]
    cases.append(Case("fused_blocks vec", blocks("vec", rot), set_isa("auto"))
                 if has_isa_switch() else Case("fused_blocks vec", blocks("vec", rot)))
    if has_isa_switch():
        cases.append(Case("fused_blocks vec, portable path", blocks("vec", rot),
                          set_isa("generic"), set_isa("auto")))
    cases.append(Case("fused_blocks amx", blocks("amx", rot)))
    cases.append(Case("fused_rows per-token chunks",
                      lambda: nb.fused_rows(src_r, ids, dst_r, idx, g.tokens, rot)))
    return cases, flat_src.numel(), len(ids) * nbytes


def _rope(g: Geometry) -> edits.RoPE:
    return edits.rope_from_config({"model_type": "llama", "head_dim": g.head_dim,
                                   "rope_theta": 500000.0})


def print_table(title: str, cases: list[Case], src_bytes: int, dst_bytes: int) -> None:
    """Medians, GB/s of the destination bytes, and each case's ratio to memcpy."""
    base = cases[0].med()
    print(f"\n== {title}: {src_bytes / MiB:.1f} MiB of sources, {dst_bytes / MiB:.1f} MiB "
          f"written ({len(cases[0].times)} reps, medians)")
    print(f"{'case':36s} {'med ms':>8s} {'min ms':>8s} {'GB/s':>7s} {'x memcpy':>9s}")
    for c in cases:
        gbps = (src_bytes if c is cases[0] else dst_bytes) / c.med() / 1e9
        print(f"{c.name:36s} {c.med() * 1e3:8.2f} {min(c.times) * 1e3:8.2f} {gbps:7.2f} "
              f"{c.med() / base:9.2f}")


def main() -> int:
    """Parse the flags, run both tables (plain and re-rotated), print them."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 reps, 2 source chunks")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--sources", type=int, default=8)
    ap.add_argument("--no-rope", action="store_true", help="skip the re-rotated table")
    args = ap.parse_args()
    reps = 3 if args.quick else args.reps
    g = Geometry(args.layers, args.heads, args.head_dim, args.block_size,
                 sources=2 if args.quick else args.sources)
    before = _native.get_threads()
    _native.set_threads(args.threads)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {args.threads} copy "
          f"threads, portable switch: {has_isa_switch()}, loadavg {os.getloadavg()[0]:.2f}")
    print(f"{g.layers} layers x {g.heads} kv heads x head {g.head_dim}, block {g.block_size}, "
          f"chunk {g.chunk}, {g.sources} source chunks, {g.dtype}, drop every 10th")
    try:
        for rope in (False,) if args.no_rope else (False, True):
            cases, src_bytes, dst_bytes = build_cases(g, rope)
            run_round_robin(cases, reps, warmup=2)
            print_table("re-rotated (llama rope)" if rope else "plain", cases, src_bytes,
                        dst_bytes)
    finally:
        _native.set_threads(before)
        if has_isa_switch():
            _native._set_fused_blocks_isa("auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
