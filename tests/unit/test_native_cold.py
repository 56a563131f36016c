"""Scatter into segment pages that do not exist yet (a fresh or punched server L1).

The native core writes part of such regions with ``pwritev`` on the segment file (no page
fault, no zeroing of a page the write covers) and the rest through the mapping with cached
stores. Whatever the split, the bytes must be exactly those of the plain mapped copy, the
mapping must see them at once, and resident regions must stay on the mapped path.
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

from lmcache_kv_fast import _native
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy.base import ChunkGeometry
from lmcache_kv_fast.testing.benchmark import punch_segment

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
def _restore_fraction() -> Iterator[None]:
    before = _native.get_cold_write_fraction()
    try:
        yield
    finally:
        _native.set_cold_write_fraction(before)


def _punch(path: str) -> None:
    assert punch_segment(path), "fallocate(PUNCH_HOLE) failed"


def _file_chunks(path: str) -> torch.Tensor:
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    return torch.frombuffer(raw, dtype=torch.bfloat16).view(N_CHUNKS, *GEOM.object_shape())


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
    # The file and the mapping (read back with a gather) both hold exactly the chunks.
    on_file = _file_chunks(path)
    for j, i in enumerate(ids):
        assert torch.equal(on_file[j], kv[:, :, i * 64:(i + 1) * 64]), (j, i)
    back = torch.zeros_like(kv)
    nb.gather(back, GEOM, ids, regions)
    assert torch.equal(back, kv)


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
