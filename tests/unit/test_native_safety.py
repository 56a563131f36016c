"""Safety of the native core: hostile descriptors raise ValueError, never crash.

Covers segment names, slot descriptors (out of bounds, overflowing, misaligned, wrong
length, overlapping), closed mappings, lying tensor sizes, chunk ids out of range,
unchecked regions, GIL release during copies, concurrent callers, fork, and the
lifetime of alloc_result tensors. The nastiest inputs also run in a subprocess so a
segfault/SIGBUS would show up as a failed exit status instead of killing pytest.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_script_refuses

pytest.importorskip("lmcache_kv_fast._native")

from lmcache_kv_fast import _native
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy.base import ChunkGeometry, Region

SEG_BYTES = 1 << 20


@dataclass(frozen=True)
class _Slot:
    offset: int
    length: int


@pytest.fixture
def seg(shm_segments: Callable[[int], str]) -> Iterator[nb.NativeSegment]:
    s = nb.open_segment(shm_segments(SEG_BYTES))
    try:
        yield s
    finally:
        s.close()


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["a/b", "/a/b", "..", "x..y", "", "/", "a\x00b",
                                  "n" * 256, "../etc/passwd"])
def test_bad_segment_names(name: str) -> None:
    with pytest.raises(ValueError):
        _native.Mapping(name)
    with pytest.raises(ValueError):
        nb.open_segment(name)


def test_missing_segment_is_file_not_found() -> None:
    with pytest.raises(FileNotFoundError):
        nb.open_segment(f"lmckv-missing-{uuid.uuid4().hex}")


def test_segment_smaller_than_expected(shm_segments: Callable[[int], str]) -> None:
    name = shm_segments(SEG_BYTES)
    with pytest.raises(ValueError, match="expected >="):
        nb.open_segment(name, SEG_BYTES + 1)
    with pytest.raises(ValueError):
        _native.Mapping(name, -1)
    s = nb.open_segment("/" + name, SEG_BYTES)  # leading slash accepted
    assert s.name == name and s.size == SEG_BYTES
    s.close()


def test_empty_segment(shm_segments: Callable[[int], str]) -> None:
    with pytest.raises(ValueError, match="empty"):
        _native.Mapping(shm_segments(0))


@pytest.mark.parametrize("mode", ["auto", "none", "map_populate", "madvise", "parallel",
                                  "parallel_read", "resident"])
def test_populate_modes(shm_segments: Callable[[int], str], mode: str) -> None:
    m = _native.Mapping(shm_segments(SEG_BYTES), populate=mode)
    assert m.size == SEG_BYTES and not m.closed and m.address > 0
    m.close()
    with pytest.raises(ValueError):
        _native.Mapping(shm_segments(SEG_BYTES), populate="bogus")


# --------------------------------------------------------------------------- slots


BAD_SLOTS = [
    ("outside", [_Slot(SEG_BYTES - 4096, 8192)], 8192, 4096, "outside"),
    ("past end", [_Slot(SEG_BYTES, 4096)], 4096, 4096, "outside"),
    ("negative offset", [_Slot(-4096, 4096)], 4096, 4096, "outside"),
    ("overflow", [_Slot(2**63 - 4096, 8192)], 8192, 4096, "outside"),
    ("huge offset", [_Slot(2**70, 4096)], 4096, 4096, "64-bit"),
    ("huge length", [_Slot(0, 2**64 + 4096)], 4096, 4096, "64-bit"),
    ("negative length", [_Slot(0, -4096)], -4096, 4096, "expected_nbytes"),
    ("misaligned", [_Slot(100, 4096)], 4096, 4096, "aligned"),
    ("wrong length", [_Slot(0, 4096), _Slot(8192, 4000)], 4096, 4096, "slot 1: length"),
    ("overlap", [_Slot(0, 8192), _Slot(4096, 8192)], 8192, 4096, "overlap"),
    ("duplicate", [_Slot(8192, 4096), _Slot(0, 4096), _Slot(8192, 4096)], 4096, 4096,
     "overlap"),
]


@pytest.mark.parametrize(("label", "slots", "expected", "align", "match"), BAD_SLOTS,
                         ids=[b[0] for b in BAD_SLOTS])
def test_bad_slots(seg: nb.NativeSegment, label: str, slots: list[_Slot], expected: int,
                   align: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        seg.regions(slots, expected, align)


def test_slot_error_names_the_slot(seg: nb.NativeSegment) -> None:
    slots = [_Slot(0, 4096), _Slot(4096, 4096), _Slot(SEG_BYTES, 4096)]
    with pytest.raises(ValueError, match="slot 2"):
        seg.regions(slots, 4096, 4096)


def test_good_slots(seg: nb.NativeSegment) -> None:
    slots = [_Slot(SEG_BYTES - 4096, 4096), _Slot(0, 4096), _Slot(4096, 4096)]
    regs = seg.regions(slots, 4096, 4096)
    base = seg.mapping.address
    assert [r.addr - base for r in regs] == [SEG_BYTES - 4096, 0, 4096]
    assert all(r.nbytes == 4096 for r in regs)
    assert seg.regions([_Slot(3, 5)], 5, 0)[0].addr == base + 3  # align <= 0: no check
    assert seg.regions([], 4096, 4096) == []


def test_non_integer_slot(seg: nb.NativeSegment) -> None:
    with pytest.raises(TypeError):
        seg.regions([_Slot("0", 4096)], 4096, 4096)  # type: ignore[arg-type]


def test_closed_mapping(seg: nb.NativeSegment) -> None:
    regs = seg.regions([_Slot(0, 4096)], 4096, 4096)
    seg.close()
    seg.close()  # idempotent
    assert seg.closed
    with pytest.raises(ValueError, match="closed"):
        seg.regions([_Slot(0, 4096)], 4096, 4096)
    with pytest.raises(ValueError, match="closed"):
        _ = seg.mapping.address
    geom = ChunkGeometry(1, 1, 16, 64, 4)  # 4096 bytes per chunk
    t = torch.zeros(1, 1, 16, 64)
    with pytest.raises(ValueError, match="closed"):
        nb.scatter(t, geom, [0], regs)
    with pytest.raises(ValueError, match="closed"):
        nb.gather(t, geom, [0], regs)


def test_segment_shrunk_after_mapping(shm_segments: Callable[[int], str]) -> None:
    """A server truncating its pool must not turn our next copy into SIGBUS."""
    name = shm_segments(SEG_BYTES)
    s = nb.open_segment(name)
    try:
        os.truncate(f"/dev/shm/{name}", SEG_BYTES // 2)
        with pytest.raises(ValueError, match="outside"):
            s.regions([_Slot(SEG_BYTES - 4096, 4096)], 4096, 4096)
        assert s.regions([_Slot(0, 4096)], 4096, 4096)
    finally:
        s.close()


# --------------------------------------------------------------------------- copies

GEOM = ChunkGeometry(2, 2, 16, 64, 4)  # 16 KiB chunks, float32


def _regions(seg: nb.NativeSegment, n: int) -> list[Region]:
    c = GEOM.chunk_nbytes
    return seg.regions([_Slot(i * c, c) for i in range(n)], c, 4096)


def test_chunk_ids_out_of_range(seg: nb.NativeSegment) -> None:
    t = torch.zeros(2, 2, 48, 64)  # 3 chunks
    regs = _regions(seg, 2)
    for ids in ([0, 3], [-1, 0], [0, 2**40]):
        with pytest.raises(ValueError, match="chunk index"):
            nb.scatter(t, GEOM, ids, regs)
        with pytest.raises(ValueError, match="chunk index"):
            nb.gather(t, GEOM, ids, regs)
    with pytest.raises(ValueError):
        nb.scatter(t, GEOM, [0], regs)  # count mismatch


def test_bad_tensor_views(seg: nb.NativeSegment) -> None:
    regs = _regions(seg, 1)
    with pytest.raises(ValueError, match="itemsize"):
        nb.scatter(torch.zeros(2, 2, 16, 64, dtype=torch.float16), GEOM, [0], regs)
    with pytest.raises(ValueError, match="contiguous"):
        nb.gather(torch.zeros(2, 2, 64, 16).transpose(2, 3), GEOM, [0], regs)
    with pytest.raises(ValueError, match="shape"):
        nb.scatter(torch.zeros(3, 2, 16, 64), GEOM, [0], regs)
    with pytest.raises(ValueError, match="exceed"):
        nb.scatter(torch.zeros(2, 2, 16, 64), GEOM, [0], regs, col_offset=1)


def test_native_validates_lying_sizes(seg: nb.NativeSegment) -> None:
    """The core itself refuses descriptors that disagree with the tensor's real size."""
    t = torch.zeros(2, 2, 32, 64)
    regs = _regions(seg, 2)
    addrs = [r.addr for r in regs]
    lens = [r.nbytes for r in regs]
    owners = [seg.mapping] * 2
    base = (t.data_ptr(), t.nbytes, (2, 2, 32, 64), 4, 64, 0, 16, [0, 1], addrs, lens, owners)
    _native.scatter(*base)  # sane
    bad = {
        "tensor too small": (1, t.nbytes - 1),
        "shape bigger than tensor": (2, (2, 2, 33, 64)),
        "huge shape": (2, (2, 2, 2**40, 2**40)),
        "negative dim": (2, (2, 2, -32, 64)),
        "col beyond D": (5, 1),
        "width 0": (4, 0),
        "chunk_tokens 0": (6, 0),
        "chunk id": (7, [0, 2]),
        "region length": (9, [lens[0], lens[1] - 1]),
        "region outside segment": (8, [addrs[0], seg.mapping.address + SEG_BYTES - 100]),
        "null tensor": (0, 0),
        "negative tensor ptr": (0, -5),
        "owner type": (10, [object(), None]),
        "owner count": (10, [seg.mapping]),
        "region over tensor": (8, [t.data_ptr(), addrs[1]]),
    }
    for label, (idx, value) in bad.items():
        args = list(base)
        args[idx] = value
        if label == "region over tensor":
            args[10] = None
        with pytest.raises((ValueError, TypeError)):
            _native.scatter(*args)
            pytest.fail(f"accepted: {label}")
        with pytest.raises((ValueError, TypeError)):
            _native.gather(*args)


def test_unchecked_regions_refused() -> None:
    t = torch.zeros(2, 2, 16, 64)
    raw = Region(t.data_ptr(), GEOM.chunk_nbytes, None)
    with pytest.raises(ValueError, match="raw addresses"):
        nb.scatter(t, GEOM, [0], [raw])
    small = torch.zeros(GEOM.chunk_nbytes - 1, dtype=torch.uint8)
    lying = Region(small.data_ptr(), GEOM.chunk_nbytes, small)
    with pytest.raises(ValueError, match="not covered"):
        nb.gather(t, GEOM, [0], [lying])
    ok = Region.of_tensor(torch.zeros(GEOM.object_shape()))
    short = Region(ok.addr, ok.nbytes - 4, ok.tensor)
    with pytest.raises(ValueError, match="expected"):
        nb.scatter(t, GEOM, [0], [short])


def test_mapped_region_outside_its_mapping(seg: nb.NativeSegment) -> None:
    t = torch.zeros(2, 2, 16, 64)
    forged = nb.MappedRegion(seg.mapping.address + SEG_BYTES - 4096, GEOM.chunk_nbytes, None,
                             seg.mapping)
    with pytest.raises(ValueError, match="outside segment"):
        nb.scatter(t, GEOM, [0], [forged])


def test_threads_api() -> None:
    old = nb.get_threads()
    try:
        for bad in (0, -1, 100000):
            with pytest.raises(ValueError):
                nb.set_threads(bad)
        nb.set_threads(3)
        assert nb.get_threads() == 3
    finally:
        nb.set_threads(old)


def test_threads_default_from_env() -> None:
    # Load the extension by path: no package __init__ / torch import in the child.
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('_native', "
            "sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.get_threads())")
    env = dict(os.environ, LMCACHE_KV_FAST_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code, _native.__file__], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "3"
    env["LMCACHE_KV_FAST_THREADS"] = "garbage"
    out = subprocess.run([sys.executable, "-c", code, _native.__file__], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout.strip()) == len(os.sched_getaffinity(0))


def test_stream_interleave_default_by_cpu_vendor_and_from_env() -> None:
    """AMD CPUs stream linearly, others walk 8 pages (csrc/copy_kernels.cpp); the
    environment overrides, and a value outside 1..64 or not a number is ignored."""
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('_native', "
            "sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.get_stream_interleave())")
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    default = "1" if amd else "8"

    def run(value: str | None) -> str:
        env = dict(os.environ)
        env.pop("LMCACHE_KV_FAST_STREAM_INTERLEAVE", None)
        if value is not None:
            env["LMCACHE_KV_FAST_STREAM_INTERLEAVE"] = value
        out = subprocess.run([sys.executable, "-c", code, _native.__file__], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.strip()

    assert run(None) == default
    assert run("4") == "4"
    assert run("64") == "64"
    for bad in ("0", "65", "-2", "garbage", ""):
        assert run(bad) == default, bad


NASTY_SCRIPT = textwrap.dedent("""
    import os, sys, uuid
    from dataclasses import dataclass
    import torch
    from lmcache_kv_fast import _native
    from lmcache_kv_fast.copy import native_backend as nb
    from lmcache_kv_fast.copy.base import ChunkGeometry, Region

    @dataclass(frozen=True)
    class S:
        offset: int
        length: int

    name = "lmckv-nasty-" + uuid.uuid4().hex[:10]
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    refused = 0
    try:
        seg = nb.open_segment(name)
        size = seg.size
        cases = [
            [S(size - 1, 2)], [S(2**63 - 1, 2)], [S(-(2**63), 2)], [S(size, 0)],
            [S(0, 2**63)], [S(2**64, 2)], [S(4096, 4096), S(4096, 4096)],
        ]
        for slots in cases:
            try:
                seg.regions(slots, slots[0].length, 1)
            except (ValueError, TypeError):
                refused += 1
        geom = ChunkGeometry(1, 1, 16, 64, 4)
        t = torch.zeros(1, 1, 16, 64)
        regs = seg.regions([S(size - 4096, 4096)], 4096, 4096)
        seg.close()
        for fn in (nb.scatter, nb.gather):
            try:
                fn(t, geom, [0], regs)
            except ValueError:
                refused += 1
        seg2 = nb.open_segment(name)
        # Truncate under the mapping, then ask for the now-missing tail.
        os.truncate("/dev/shm/" + name, 4096)
        try:
            seg2.regions([S(8192, 4096)], 4096, 4096)
        except ValueError:
            refused += 1
        forged = nb.MappedRegion(seg2.mapping.address + (1 << 20) - 100, 4096, None,
                                 seg2.mapping)
        try:
            nb.gather(t, geom, [0], [forged])
        except ValueError:
            refused += 1
        try:
            _native.gather(t.data_ptr(), 10, (1, 1, 16, 64), 4, 64, 0, 16, [0],
                           [forged.addr], [4096], [seg2.mapping])
        except ValueError:
            refused += 1
        seg2.close()
    finally:
        os.unlink("/dev/shm/" + name)
    print("REFUSED", refused)
""")


def test_nasty_inputs_in_subprocess() -> None:
    # 6 of the 7 slot sets are refused (S(size, 0) with length 0 is legal), plus 5 copies.
    assert_script_refuses(NASTY_SCRIPT, 11, timeout=120)


# --------------------------------------------------------------------------- threads


def test_gil_released_during_copy() -> None:
    """A Python thread keeps running while a large native copy runs.

    One gather call copies the same 64 MiB region 16 times (duplicate chunk ids run
    sequentially), i.e. ~1 GiB in one call. A spinner thread timestamps its progress; with
    the GIL held for the call it could not run at all in the middle of it.
    """
    chunk = 64 << 20
    src = torch.ones(chunk, dtype=torch.uint8)
    dst = torch.zeros(chunk, dtype=torch.uint8).view(1, 1, chunk // 4096, 4096)
    regs = [Region.of_tensor(src)] * 16
    geom = ChunkGeometry(1, 1, chunk // 4096, 4096, 1)
    stamps: list[float] = []
    stop = threading.Event()
    started = threading.Event()

    def spin() -> None:
        started.set()
        k = 0
        while not stop.is_set():
            k += 1
            if k % 200 == 0:
                stamps.append(time.perf_counter())

    th = threading.Thread(target=spin)
    old = nb.get_threads()
    nb.set_threads(1)  # leave a core for the spinner
    windows = []
    try:
        th.start()
        started.wait()
        for _ in range(3):
            t0 = time.perf_counter()
            nb.gather(dst, geom, [0] * 16, regs)
            windows.append((t0, time.perf_counter()))
    finally:
        stop.set()
        th.join()
        nb.set_threads(old)
    assert bool((dst == 1).all())
    inside = []
    for t0, t1 in windows:
        lo, hi = t0 + 0.2 * (t1 - t0), t1 - 0.2 * (t1 - t0)
        inside.append(sum(1 for t in stamps if lo < t < hi))
    assert max(inside) >= 3, (inside, [t1 - t0 for t0, t1 in windows])


def test_concurrent_callers_are_correct() -> None:
    """Several Python threads copying at once (pool busy -> caller-thread copies)."""
    geom = ChunkGeometry(2, 4, 128, 512, 2)
    errors: list[str] = []

    def worker(k: int) -> None:
        gen = torch.Generator().manual_seed(k)
        src = torch.randint(-1000, 1000, (2, 4, 1024, 512), generator=gen).to(torch.bfloat16)
        regs = [Region.of_tensor(torch.empty(geom.object_shape(), dtype=torch.bfloat16))
                for _ in range(8)]
        for _ in range(5):
            ids = list(range(8))
            random.Random(k).shuffle(ids)
            nb.scatter(src, geom, ids, regs)
            out = torch.zeros_like(src)
            nb.gather(out, geom, ids, regs)
            if not torch.equal(out, src):
                errors.append(f"thread {k} mismatch")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_close_while_copy_runs(shm_segments: Callable[[int], str]) -> None:
    """close() during a copy defers the munmap until the copy ends (no SIGSEGV)."""
    size = 128 << 20
    s = nb.open_segment(shm_segments(size))
    geom = ChunkGeometry(1, 1, 1024, size // 1024, 1)
    regs = s.regions([_Slot(0, size)], size, 4096)
    src = torch.ones(1, 1, 1024, size // 1024, dtype=torch.uint8)
    outcomes: list[str] = []
    running = threading.Event()

    def copy() -> None:
        for _ in range(6):
            try:
                running.set()
                nb.scatter(src, geom, [0], regs)
                outcomes.append("copied")
            except ValueError as err:
                outcomes.append(f"refused: {err}")

    th = threading.Thread(target=copy)
    th.start()
    running.wait()
    time.sleep(0.005)
    s.close()  # lands during or between copies; later copies must refuse
    th.join()
    assert s.closed
    assert all(o == "copied" or "closed" in o for o in outcomes), outcomes
    assert outcomes[-1].startswith("refused")


def test_fork_child_can_copy() -> None:
    """After fork the pool's threads are gone; the child must get a working new pool."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    src = torch.arange(4 << 20, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros_like(src)
    _native.memcpy(dst.data_ptr(), src.data_ptr(), src.numel())  # the pool exists now
    d2 = torch.zeros_like(src)
    expect = src.numpy().tobytes()
    pid = os.fork()
    if pid == 0:  # child: only the native core and numpy (no OpenMP regions after fork)
        code = 1
        try:
            _native.memcpy(d2.data_ptr(), src.data_ptr(), src.numel())
            buf = _native.ResultBuffer(8 << 20)
            mv = memoryview(buf)
            mv[-1] = 3
            code = 0 if d2.numpy().tobytes() == expect and mv[-1] == 3 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --------------------------------------------------------------------------- alloc_result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8,
                                   torch.float64, torch.bool])
def test_alloc_result_basic(dtype: torch.dtype) -> None:
    for shape in [(2, 4, 1024, 512), (3, 5), (0, 7), (2, 32, 257, 128)]:
        t = nb.alloc_result(shape, dtype)
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
        assert t.device.type == "cpu"
        t.fill_(1)
        assert bool((t == 1).all())
        (t + 1).sum()


def test_alloc_result_survives_recycling() -> None:
    shape, dtype = (4, 1024, 1024), torch.float32  # 16 MiB, pooled path
    a = nb.alloc_result(shape, dtype)
    a.fill_(7)
    b = nb.alloc_result(shape, dtype)
    b_ptr = b.data_ptr()
    del b
    gc.collect()
    c = nb.alloc_result(shape, dtype)  # recycles b's buffer
    assert c.data_ptr() == b_ptr
    c.fill_(-1)
    assert bool((a == 7).all())
    view = a[1:3]
    del a
    gc.collect()
    d = nb.alloc_result(shape, dtype)  # must not get a's memory: the view keeps it
    d.fill_(5)
    assert bool((view == 7).all())
    del c, d, view


def test_alloc_result_random_free_order() -> None:
    old = _native.result_pool_stats()["limit"]
    _native.set_result_pool_limit(24 << 20)  # force evictions
    try:
        rng = random.Random(5)
        live: list[torch.Tensor] = []
        for k in range(40):
            n = rng.choice([3 << 20, 5 << 20, 8 << 20, 1 << 10])
            t = nb.alloc_result((n,), torch.uint8)
            t[0] = k % 256
            t[-1] = k % 256
            live.append(t)
            if rng.random() < 0.3:
                live.append(t[rng.randrange(n):])  # a view keeps the buffer alive too
            if len(live) > 6:
                rng.shuffle(live)
                for _ in range(rng.randint(1, 4)):
                    live.pop()
        rng.shuffle(live)
        while live:
            live.pop()
        gc.collect()
        st = _native.result_pool_stats()
        assert st["pooled_bytes"] <= 24 << 20
        assert st["evictions"] > 0
    finally:
        _native.set_result_pool_limit(old)
        _native.result_pool_trim()
    assert _native.result_pool_stats()["pooled_bytes"] == 0


@pytest.mark.parametrize(("nbytes", "capacity"), [
    (1, 2 << 20), (3 << 20, 4 << 20), (16 << 20, 16 << 20), ((16 << 20) + 1, 20 << 20),
    (int(57.6 * 2**20), 64 << 20), (64 << 20, 64 << 20), ((64 << 20) + 1, 80 << 20),
    (100 << 20, 112 << 20),
])
def test_result_capacity_classes(nbytes: int, capacity: int) -> None:
    """Whole huge pages; from 16 MiB up, quarter-power-of-two classes."""
    assert _native.ResultBuffer(nbytes, pool=False).capacity == capacity


def test_results_of_nearby_sizes_share_pooled_buffers() -> None:
    """A read of a 2,048-token stream takes the buffer its edit (every 10th token dropped,
    57.6 MiB) used: no new mapping, no page faults."""
    _native.result_pool_trim()
    edit = nb.alloc_result((2, 8, 1843, 1024), torch.bfloat16)  # 57.6 MiB
    ptr = edit.data_ptr()
    del edit
    gc.collect()
    misses = _native.result_pool_stats()["misses"]
    read = nb.alloc_result((2, 8, 2048, 1024), torch.bfloat16)  # 64 MiB
    try:
        assert read.data_ptr() == ptr
        assert _native.result_pool_stats()["misses"] == misses
        read.fill_(3)  # the class's slack pages are usable memory
        assert bool((read[:, :, -1] == 3).all())
    finally:
        del read
        gc.collect()
        _native.result_pool_trim()


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rss_kib_of_mapping(addr: int) -> int:
    """Resident KiB of the mapping of /proc/self/smaps that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_results_from_1_mib_are_pooled_and_fault_their_own_pages_only() -> None:
    """From 1 MiB a result is a pool buffer (glibc's heap grows under such blocks); a
    fresh one's pages are faulted for its own bytes, not its 2 MiB region's slack."""
    if nb.MIN_POOLED_RESULT_BYTES != 1 << 20:
        raise AssertionError(nb.MIN_POOLED_RESULT_BYTES)
    _native.result_pool_trim()
    try:
        m0 = _native.result_pool_stats()["misses"]
        small = nb.alloc_result(((1 << 20) - 2,), torch.uint8)
        assert _native.result_pool_stats()["misses"] == m0  # torch.empty: not the pool
        a = nb.alloc_result((1_100_000,), torch.uint8)
        assert _native.result_pool_stats()["misses"] == m0 + 1
        assert a.data_ptr() % (2 << 20) == 0
        rss = _rss_kib_of_mapping(a.data_ptr())
        assert 1_100_000 // 1024 <= rss <= 1_100_000 // 1024 + 8, rss  # not 2,048
        a.fill_(7)
        ptr = a.data_ptr()
        del a
        gc.collect()
        b = nb.alloc_result((1_900_000,), torch.uint8)  # the slack is usable: same buffer
        assert b.data_ptr() == ptr and _native.result_pool_stats()["misses"] == m0 + 1
        b.fill_(9)
        assert int(b[-1]) == 9 and small.numel() == (1 << 20) - 2
        del b
    finally:
        gc.collect()
        _native.result_pool_trim()


def test_reserved_results_are_faulted_ahead_and_served_from_the_pool() -> None:
    """reserve_results maps and populates buffers that the next results take: no miss,
    and writing every byte of them takes (almost) no page fault."""
    _native.result_pool_trim()
    try:
        r0 = _native.result_pool_stats()
        assert nb.reserve_results(8 << 20, 3) == 3
        r1 = _native.result_pool_stats()
        assert r1["reserved"] - r0["reserved"] == 3
        assert r1["entries"] == 3 and r1["pooled_bytes"] == 3 * (8 << 20)
        assert nb.reserve_results(8 << 20, 3) == 0  # already held: nothing more
        assert nb.reserve_results(7 << 20, 2) == 0  # those serve a 7 MiB result too
        f0 = _minflt()
        ts = [nb.alloc_result((8 << 20,), torch.uint8) for _ in range(3)]
        for k, t in enumerate(ts):
            t.fill_(k + 1)
        faults = _minflt() - f0
        r2 = _native.result_pool_stats()
        assert r2["misses"] == r1["misses"] and r2["hits"] - r1["hits"] == 3
        assert faults < 3 * (8 << 20) // 4096 // 8, faults  # 6,144 pages written
        assert [int(t[-1]) for t in ts] == [1, 2, 3]
        del ts
        gc.collect()
    finally:
        _native.result_pool_trim()


def test_reserve_results_stays_within_the_pool_limit_and_checks_its_arguments() -> None:
    old = _native.result_pool_stats()["limit"]
    _native.result_pool_trim()
    _native.set_result_pool_limit(20 << 20)
    try:
        assert nb.reserve_results(8 << 20, 5) == 2  # 20 MiB hold two 8 MiB buffers
        assert _native.result_pool_stats()["pooled_bytes"] == 16 << 20
        assert nb.reserve_results(512 << 10, 4) == 0  # not pooled: nothing to reserve
        assert nb.reserve_results(64 << 20, 1) == 0  # above the limit
        assert nb.reserve_results(8 << 20, 0) == 0
        with pytest.raises(ValueError, match="nbytes, count >= 0"):
            nb.reserve_results(-1, 1)
        with pytest.raises(ValueError, match="count"):
            _native.result_pool_reserve(8 << 20, 5000)
        with pytest.raises(ValueError, match="too large"):
            _native.result_pool_reserve(1 << 47, 1)
        with pytest.raises(TypeError):
            _native.result_pool_reserve("8", 1)
        from lmcache_kv_fast.copy import torch_backend
        assert torch_backend.reserve_results(8 << 20, 2) == 0
        with pytest.raises(ValueError, match="nbytes, count >= 0"):
            torch_backend.reserve_results(1, -1)
    finally:
        _native.set_result_pool_limit(old)
        _native.result_pool_trim()


def test_result_buffer_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        _native.ResultBuffer(0)
    with pytest.raises(ValueError):
        _native.ResultBuffer(-1)
    with pytest.raises(ValueError):
        _native.ResultBuffer(1, prefault="bogus")
    with pytest.raises(ValueError):
        nb.alloc_result((-1, 4), torch.float32)
