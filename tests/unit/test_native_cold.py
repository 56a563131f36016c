"""Scatter into segment pages that do not exist yet (a fresh or punched server L1).

With two or more copy threads the native core fills such regions with ``UFFDIO_COPY``
(tests marked ``uffd``); otherwise, or where userfaultfd is unavailable, it writes part of
them with ``pwritev`` on the segment file (no page fault, no zeroing of a page the write
covers) and the rest through the mapping with cached stores. Whatever the split, the
bytes must be exactly those of the plain mapped copy, the mapping must see them at once,
and resident regions must stay on the mapped path.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from conftest import create_shm_segment

pytest.importorskip("lmcache_kv_fast._native")

from benches.harness.helpers import punch_segment
from lmcache_kv_fast import _native
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy.base import ChunkGeometry

GEOM = ChunkGeometry(2, 4, 64, 256, 2)  # 256 KiB chunks, bf16
N_CHUNKS = 8


@dataclass(frozen=True)
class _Slot:
    offset: int
    length: int


@pytest.fixture
def segment() -> Iterator[tuple[str, nb.NativeSegment]]:
    name = create_shm_segment(N_CHUNKS * GEOM.chunk_nbytes, "cold")
    path = f"/dev/shm/{name}"
    seg = nb.open_segment(name)
    try:
        yield path, seg
    finally:
        seg.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture(autouse=True)
def _restore_fraction(request: pytest.FixtureRequest) -> Iterator[None]:
    """Restore the cold-path settings; tests not marked ``uffd`` run without UFFDIO_COPY
    (they pin down the write(2) / mapping split)."""
    before = _native.get_cold_write_fraction()
    uffd_before = _native.get_cold_uffd()
    threads_before = _native.get_threads()
    _native.set_cold_uffd("uffd" in request.keywords)
    try:
        yield
    finally:
        _native.set_cold_write_fraction(before)
        _native.set_cold_uffd(uffd_before)
        _native.set_threads(threads_before)
        _native._set_uffd_fault(0)


def _punch(path: str) -> None:
    assert punch_segment(path), "fallocate(PUNCH_HOLE) failed"


def _file_chunks(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    return torch.frombuffer(raw, dtype=torch.bfloat16).view(N_CHUNKS, *GEOM.object_shape())


def _assert_holds(path: str, regions: list, kv: torch.Tensor, ids: list[int]) -> None:
    """The file and the mapping (read back with a gather) both hold exactly the chunks."""
    on_file = _file_chunks(path)
    for j, i in enumerate(ids):
        assert torch.equal(on_file[j], kv[:, :, i * 64:(i + 1) * 64]), (j, i)
    back = torch.zeros_like(kv)
    nb.gather(back, GEOM, ids, regions)
    assert torch.equal(back, kv)


def _kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, tokens, 256, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("fraction", [-1.0, 0.0, 0.5, 1.0])
def test_cold_scatter_is_exact(segment: tuple[str, nb.NativeSegment], fraction: float) -> None:
    path, seg = segment
    _native.set_cold_write_fraction(fraction)
    kv = _kv(N_CHUNKS * GEOM.chunk_tokens, seed=1)
    slots = [_Slot(i * GEOM.chunk_nbytes, GEOM.chunk_nbytes) for i in range(N_CHUNKS)]
    regions = seg.regions(slots, GEOM.chunk_nbytes, 4096)
    ids = list(reversed(range(N_CHUNKS)))  # chunk i -> slot N-1-i
    before = _native.copy_stats()
    nb.scatter(kv, GEOM, ids, regions)
    after = _native.copy_stats()
    assert after["cold_regions"] - before["cold_regions"] == N_CHUNKS
    file_bytes = after["file_write_bytes"] - before["file_write_bytes"]
    total = N_CHUNKS * GEOM.chunk_nbytes
    expected = {0.0: 0, 0.5: total // 2, 1.0: total}.get(fraction)
    if expected is not None:
        assert file_bytes == expected
    else:
        assert 0 < file_bytes <= total
    _assert_holds(path, regions, kv, ids)


def test_resident_regions_stay_on_the_mapping(segment: tuple[str, nb.NativeSegment]) -> None:
    path, seg = segment
    _native.set_cold_write_fraction(1.0)
    slots = [_Slot(i * GEOM.chunk_nbytes, GEOM.chunk_nbytes) for i in range(N_CHUNKS)]
    regions = seg.regions(slots, GEOM.chunk_nbytes, 4096)
    first = _kv(N_CHUNKS * 64, seed=2)
    nb.scatter(first, GEOM, range(N_CHUNKS), regions)  # now every page is allocated
    second = _kv(N_CHUNKS * 64, seed=3)
    before = _native.copy_stats()
    nb.scatter(second, GEOM, range(N_CHUNKS), regions)
    after = _native.copy_stats()
    assert after["cold_regions"] == before["cold_regions"]
    assert after["file_write_bytes"] == before["file_write_bytes"]
    back = torch.zeros_like(second)
    nb.gather(back, GEOM, range(N_CHUNKS), regions)
    assert torch.equal(back, second)
    # Punched (like a cleared, released L1): cold again, written exactly again.
    _punch(path)
    nb.scatter(first, GEOM, range(N_CHUNKS), regions)
    assert _native.copy_stats()["cold_regions"] - after["cold_regions"] == N_CHUNKS
    nb.gather(back, GEOM, range(N_CHUNKS), regions)
    assert torch.equal(back, first)


def test_half_resident_store(segment: tuple[str, nb.NativeSegment]) -> None:
    _, seg = segment
    _native.set_cold_write_fraction(1.0)
    c = GEOM.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(N_CHUNKS)], c, 4096)
    warm = _kv(4 * 64, seed=4)
    nb.scatter(warm, GEOM, range(4), regions[:4])
    kv = _kv(N_CHUNKS * 64, seed=5)
    before = _native.copy_stats()
    nb.scatter(kv, GEOM, range(N_CHUNKS), regions)
    after = _native.copy_stats()
    assert after["cold_regions"] - before["cold_regions"] == 4
    assert after["file_write_bytes"] - before["file_write_bytes"] == 4 * c
    back = torch.zeros_like(kv)
    nb.gather(back, GEOM, range(N_CHUNKS), regions)
    assert torch.equal(back, kv)


def test_tensor_parallel_shard_into_cold_pages(segment: tuple[str, nb.NativeSegment]) -> None:
    """Strided rows (a TP shard's columns) cannot be one write: mapped, cached stores."""
    _, seg = segment
    _native.set_cold_write_fraction(1.0)
    shard = ChunkGeometry(2, 4, 64, 128, 2)  # half of D=256
    c = shard.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(4)], c, 4096)
    kv = _kv(4 * 64, seed=6)
    before = _native.copy_stats()
    nb.scatter(kv, shard, range(4), regions, col_offset=128)
    after = _native.copy_stats()
    assert after["file_write_bytes"] == before["file_write_bytes"]
    assert after["cold_mapped_bytes"] - before["cold_mapped_bytes"] == 4 * c
    back = torch.zeros_like(kv)
    nb.gather(back, shard, range(4), regions, col_offset=128)
    assert torch.equal(back[..., 128:], kv[..., 128:])


@pytest.mark.parametrize("bad", [1.5, -0.5, -2.0, float("nan")])
def test_fraction_validation(bad: float) -> None:
    with pytest.raises(ValueError, match="cold write fraction"):
        _native.set_cold_write_fraction(bad)


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem")


def _resident_segment(nbytes: int) -> str:
    name = create_shm_segment(nbytes, "bgpop")
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        chunk = b"\x01" * (1 << 20)
        for off in range(0, nbytes // 2, 1 << 20):  # the first half gets pages
            os.pwrite(fd, chunk, off)
    finally:
        os.close(fd)
    return name


def test_background_populate_maps_only_resident_pages() -> None:
    size = 64 << 20
    name = _resident_segment(size)
    try:
        before = _rss_shmem()
        seg = nb.open_segment(name)  # returns at once; a thread maps the resident half
        try:
            assert seg.wait_populated(timeout=30)
            grown = _rss_shmem() - before
            assert size // 2 - (1 << 20) <= grown <= size // 2 + (4 << 20), grown
            # and the mapping reads what the file holds
            c = GEOM.chunk_nbytes
            regions = seg.regions([_Slot(0, c)], c, 4096)
            back = torch.zeros(2, 4, 64, 256, dtype=torch.bfloat16)
            nb.gather(back, GEOM, [0], regions)
            assert torch.equal(back.view(torch.uint8), torch.ones(c, dtype=torch.uint8).view(
                2, 4, 64, 512))
        finally:
            seg.close()
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_close_while_populating_and_bad_ranges() -> None:
    size = 256 << 20
    name = _resident_segment(size)
    try:
        for _ in range(3):
            seg = nb.open_segment(name)
            seg.close()  # stops the populater between windows, then unmaps
            assert seg.closed and seg.wait_populated(timeout=5)
        m = _native.Mapping(name, None, "none")
        try:
            for off, ln in [(size + 1, 0), (0, size + 1), (size - 4096, 8192)]:
                with pytest.raises(ValueError, match="outside"):
                    m.populate_resident(off, ln)
            assert m.populate_resident(0, 0) == 0
            assert m.populate_resident(size // 2, size // 2) == 0  # no pages there
            assert m.populate_resident(0, 1 << 20) == 256
        finally:
            m.close()
        with pytest.raises(ValueError):
            m.populate_resident(0, 4096)
    finally:
        os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def _no_fault() -> Iterator[None]:
    try:
        yield
    finally:
        _native._set_file_write_fault(0)


def test_file_write_failure_falls_back_to_the_mapping(
        segment: tuple[str, nb.NativeSegment], _no_fault: None) -> None:
    """A file system that refuses pwritev: the scatter is redone through the mapping,
    exactly, and later scatters stop trying files."""
    _, seg = segment
    _native.set_cold_write_fraction(1.0)
    c = GEOM.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(N_CHUNKS)], c, 4096)
    _native._set_file_write_fault(errno.EINVAL)
    kv = _kv(N_CHUNKS * 64, seed=8)
    before = _native.copy_stats()
    nb.scatter(kv, GEOM, range(N_CHUNKS), regions)
    after = _native.copy_stats()
    assert after["file_write_fallbacks"] == before["file_write_fallbacks"] + 1
    assert after["file_writes_disabled"] == 1
    back = torch.zeros_like(kv)
    nb.gather(back, GEOM, range(N_CHUNKS), regions)
    assert torch.equal(back, kv)
    _punch(segment[0])
    nb.scatter(kv, GEOM, range(N_CHUNKS), regions)  # cold again: no file write tried
    assert _native.copy_stats()["file_write_bytes"] == after["file_write_bytes"]
    _native._set_file_write_fault(0)
    assert _native.copy_stats()["file_writes_disabled"] == 0


def test_full_file_system_raises_enospc_instead_of_sigbus(
        segment: tuple[str, nb.NativeSegment], _no_fault: None) -> None:
    _, seg = segment
    _native.set_cold_write_fraction(-1.0)
    c = GEOM.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(N_CHUNKS)], c, 4096)
    _native._set_file_write_fault(errno.ENOSPC)
    with pytest.raises(OSError) as ei:
        nb.scatter(_kv(N_CHUNKS * 64, seed=9), GEOM, range(N_CHUNKS), regions)
    assert ei.value.errno == errno.ENOSPC
    assert _native.copy_stats()["file_writes_disabled"] == 0  # ENOSPC does not disable
    with pytest.raises(ValueError, match="errno"):
        _native._set_file_write_fault(-1)


# --------------------------------------------------------------------------- UFFDIO_COPY


def _scatter_cold(seg: nb.NativeSegment, kv: torch.Tensor, ids: list[int], geom: ChunkGeometry,
                  n_regions: int, col_offset: int = 0) -> tuple[list, dict, dict]:
    c = geom.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(n_regions)], c, 4096)
    before = _native.copy_stats()
    nb.scatter(kv, geom, ids, regions, col_offset=col_offset)
    return regions, before, _native.copy_stats()


@pytest.mark.uffd
def test_uffd_fill_is_exact_and_used(segment: tuple[str, nb.NativeSegment]) -> None:
    path, seg = segment
    _native.set_threads(2)
    kv = _kv(N_CHUNKS * 64, seed=11)
    ids = list(reversed(range(N_CHUNKS)))
    regions, before, after = _scatter_cold(seg, kv, ids, GEOM, N_CHUNKS)
    total = N_CHUNKS * GEOM.chunk_nbytes
    assert after["cold_regions"] - before["cold_regions"] == N_CHUNKS
    filled = after["uffd_fill_bytes"] - before["uffd_fill_bytes"]
    if after["uffd_unavailable"]:  # no userfaultfd here: the write(2) split did it
        assert filled == 0 and after["file_write_bytes"] > before["file_write_bytes"]
    else:
        assert filled == total
        assert after["file_write_bytes"] == before["file_write_bytes"]
    _assert_holds(path, regions, kv, ids)
    # Punched again: filled again (the ranges were unregistered, the fd is reused).
    _punch(path)
    kv2 = _kv(N_CHUNKS * 64, seed=12)
    nb.scatter(kv2, GEOM, ids, regions)
    _assert_holds(path, regions, kv2, ids)


@pytest.mark.uffd
def test_uffd_fill_unaligned_runs_and_regions() -> None:
    """Runs and regions that are not whole pages: interiors filled, edges mapped."""
    geom = ChunkGeometry(2, 3, 24, 200, 2)  # 19200-byte runs: 4.69 pages
    c = geom.chunk_nbytes
    n = 5
    name = create_shm_segment(n * c + 3 * 4096, "cold-odd")
    seg = nb.open_segment(name)
    try:
        _native.set_threads(2)
        # slots at odd offsets, 64-byte aligned, with gaps between them
        slots = [_Slot(100 * 64 + i * (c + 1088), c) for i in range(n)]
        regions = seg.regions(slots, c, 64)
        g = torch.Generator().manual_seed(13)
        kv = torch.randn(2, 3, n * 24, 200, generator=g).to(torch.bfloat16)
        nb.scatter(kv, geom, range(n), regions)
        back = torch.zeros_like(kv)
        nb.gather(back, geom, range(n), regions)
        assert torch.equal(back, kv)
        # the gaps between slots stay zero
        raw = open(f"/dev/shm/{name}", "rb").read()  # noqa: SIM115 - read and closed at once
        for i in range(n - 1):
            gap = raw[slots[i].offset + c:slots[i + 1].offset]
            assert gap == bytes(len(gap)), i
    finally:
        seg.close()
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.uffd
@pytest.mark.parametrize("err", [errno.EEXIST, errno.ENOMEM, errno.EFAULT])
def test_uffd_partial_fill_failures_finish_exactly(segment: tuple[str, nb.NativeSegment],
                                                   err: int) -> None:
    """Every UFFDIO_COPY places half its pages then fails: the rest is copied (EEXIST:
    through the mapping; other errors: through write(2)), byte-exact."""
    path, seg = segment
    _native.set_threads(2)
    _native._set_uffd_fault(err)
    kv = _kv(N_CHUNKS * 64, seed=14)
    regions, before, after = _scatter_cold(seg, kv, list(range(N_CHUNKS)), GEOM, N_CHUNKS)
    if not after["uffd_unavailable"]:
        filled = after["uffd_fill_bytes"] - before["uffd_fill_bytes"]
        assert 0 < filled < N_CHUNKS * GEOM.chunk_nbytes
        wrote = after["file_write_bytes"] - before["file_write_bytes"]
        assert (wrote == 0) if err == errno.EEXIST else (wrote > 0)
    _assert_holds(path, regions, kv, list(range(N_CHUNKS)))


@pytest.mark.uffd
def test_uffd_fill_failure_on_a_full_file_system_raises_enospc(
        segment: tuple[str, nb.NativeSegment]) -> None:
    """A fill that runs out of memory continues with write(2); a full tmpfs then says ENOSPC."""
    _, seg = segment
    _native.set_threads(2)
    _native._set_uffd_fault(errno.ENOMEM)
    _native._set_file_write_fault(errno.ENOSPC)
    try:
        c = GEOM.chunk_nbytes
        regions = seg.regions([_Slot(i * c, c) for i in range(N_CHUNKS)], c, 4096)
        if _native.copy_stats()["uffd_unavailable"]:
            pytest.skip("userfaultfd unavailable: covered by the write(2) ENOSPC test")
        with pytest.raises(OSError) as ei:
            nb.scatter(_kv(N_CHUNKS * 64, seed=15), GEOM, range(N_CHUNKS), regions)
        assert ei.value.errno == errno.ENOSPC
    finally:
        _native._set_file_write_fault(0)


@pytest.mark.uffd
def test_uffd_mixed_regions_tp_shard_and_resident(segment: tuple[str, nb.NativeSegment]) -> None:
    """Resident regions and strided (TP shard) cold regions stay on the mapping, unregistered."""
    _, seg = segment
    _native.set_threads(2)
    shard = ChunkGeometry(2, 4, 64, 128, 2)
    c = shard.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(2 * N_CHUNKS)], c, 4096)
    kv = _kv(N_CHUNKS * 64, seed=16)
    nb.scatter(kv, shard, range(4), regions[:4], col_offset=128)  # cold, strided: mapped
    half = regions[4:8] + regions[N_CHUNKS:N_CHUNKS + 4]  # 4 resident-to-be + 4 cold
    flat = ChunkGeometry(2, 4, 64, 128, 2)
    x = torch.randn(2, 4, 8 * 64, 128, generator=torch.Generator().manual_seed(17))
    x = x.to(torch.bfloat16)
    nb.scatter(x[:, :, :4 * 64].contiguous(), flat, range(4), half[:4])  # now resident
    before = _native.copy_stats()
    nb.scatter(x, flat, range(8), half)
    after = _native.copy_stats()
    assert after["cold_regions"] - before["cold_regions"] == 4
    back = torch.zeros_like(x)
    nb.gather(back, flat, range(8), half)
    assert torch.equal(back, x)
    b2 = torch.zeros_like(kv)
    nb.gather(b2, shard, range(4), regions[:4], col_offset=128)
    assert torch.equal(b2[:, :, :4 * 64, 128:], kv[:, :, :4 * 64, 128:])


@pytest.mark.uffd
def test_uffd_concurrent_scatters_and_fork(segment: tuple[str, nb.NativeSegment]) -> None:
    """Two threads fill disjoint cold regions at once; a forked child fills with its own fd."""
    import threading

    path, seg = segment
    _native.set_threads(2)
    c = GEOM.chunk_nbytes
    regions = seg.regions([_Slot(i * c, c) for i in range(N_CHUNKS)], c, 4096)
    kvs = [_kv(4 * 64, seed=20 + t) for t in range(2)]
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for _ in range(3):
                nb.scatter(kvs[t], GEOM, range(4), regions[4 * t:4 * t + 4])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and not any(th.is_alive() for th in threads)
    for t in range(2):
        back = torch.zeros_like(kvs[t])
        nb.gather(back, GEOM, range(4), regions[4 * t:4 * t + 4])
        assert torch.equal(back, kvs[t])
    _punch(path)
    kv = _kv(N_CHUNKS * 64, seed=30)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            nb.scatter(kv, GEOM, range(N_CHUNKS), regions)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    on_file = _file_chunks(path)
    for i in range(N_CHUNKS):
        assert torch.equal(on_file[i], kv[:, :, i * 64:(i + 1) * 64]), i


def test_uffd_setting_round_trip() -> None:
    _native.set_cold_uffd(True)
    assert _native.get_cold_uffd() is True
    _native.set_cold_uffd(False)
    assert _native.get_cold_uffd() is False
    with pytest.raises(ValueError, match="errno"):
        _native._set_uffd_fault(-1)


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False)])
def test_uffd_env_switch(value: str | None, expected: bool) -> None:
    """LMCACHE_KV_FAST_COLD_UFFD=0 starts the process with fills off."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_KV_FAST_COLD_UFFD"}
    if value is not None:
        env["LMCACHE_KV_FAST_COLD_UFFD"] = value
    out = subprocess.run(
        [sys.executable, "-c", "from lmcache_kv_fast import _native; print(_native.get_cold_uffd())"],
        env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(expected)


def test_mapping_cold_reports_unallocated_pages(segment: tuple[str, nb.NativeSegment]) -> None:
    """``Mapping.cold``: the per-chunk converting store's test for never-allocated slots."""
    path, seg = segment
    m = seg.mapping
    n = GEOM.chunk_nbytes
    assert m.cold(m.address, n) and m.cold(m.address + n, n)  # a fresh (sparse) segment
    with open(path, "r+b") as f:  # allocate the first chunk's pages
        f.write(b"\1" * n)
    assert not m.cold(m.address, n)
    assert m.cold(m.address + n, n)
    # outside the mapping, or empty: not cold (the copy itself refuses bad regions)
    assert not m.cold(m.address + m.size, n)
    assert not m.cold(m.address, 0)
    _punch(path)
    assert m.cold(m.address, n)
    seg.close()
    with pytest.raises(ValueError, match="closed"):
        m.cold(m.address, n)
