"""client/instances.py (this process's own instance ids) and client/engine_kv.py's pieces that
need no server: connect()'s engine options and the per-chunk converter."""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from lmcache_kv_fast.client.engine_kv import EngineKVCopy, EngineOptions
from lmcache_kv_fast.client.instances import (
    new_instance_id,
    own_instance_ids,
    release_instance_id,
)
from lmcache_kv_fast.copy import ChunkGeometry, Region
from lmcache_kv_fast.copy.select import backend
from lmcache_kv_fast.layout import CpuEngineKV


def test_instance_ids_are_recorded_until_released():
    ids = {new_instance_id() for _ in range(100)}
    assert len(ids) == 100 and all(0 < i < 2**63 for i in ids)
    assert ids <= own_instance_ids()
    for i in ids:
        release_instance_id(i)
    assert not ids & own_instance_ids()
    release_instance_id(12345)  # unknown: ignored


def test_engine_options_checked():
    assert not EngineOptions().given
    assert EngineOptions(block_size=128).given
    EngineOptions(model_config={"num_hidden_layers": 2}, dtype="bfloat16", kernel="vec")
    with pytest.raises(InvalidTypeError, match="model_config"):
        EngineOptions(model_config=42)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        EngineOptions(block_size=0)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        EngineOptions(block_size=True)
    with pytest.raises(InvalidTypeError, match="dtype"):
        EngineOptions(dtype=3)
    with pytest.raises(InvalidTypeError, match="kernel"):
        EngineOptions(kernel=3)


def _geom(cpu: CpuEngineKV, chunk: int) -> ChunkGeometry:
    return ChunkGeometry(planes=1, layers=cpu.num_layers, chunk_tokens=chunk,
                         width=cpu.num_kv_heads * 2 * cpu.head_dim, itemsize=2)


def test_chunk_copies_through_regions_both_ways():
    """Regions with a tensor (torch backend, pickle frames) and bare addresses (SHM slots)."""
    cpu = CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "vec")
    be = backend()
    conv = EngineKVCopy(cpu, _geom(cpu, 256), be.gather)
    kv = torch.randn(2, 2, 768, 128).to(torch.bfloat16)
    objs = [torch.zeros(2, 256, 256, dtype=torch.bfloat16) for _ in range(3)]
    bare = [Region(o.data_ptr(), o.numel() * 2) for o in objs[:2]] + [Region.of_tensor(objs[2])]
    conv.copy(be.scatter, kv, [0, 1, 2], bare)  # a store: per-token -> the engine's rows
    for i, o in enumerate(objs):
        assert torch.equal(o, cpu.to_raw(kv[:, :, i * 256:(i + 1) * 256].contiguous()))
    out = torch.zeros(2, 2, 1024, 128, dtype=torch.bfloat16)
    conv.copy(be.gather, out, [2, 0, 1], [bare[2], bare[0], bare[1]])  # a retrieve
    assert torch.equal(out[:, :, :768], kv) and not out[:, :, 768:].any()
    assert conv.kv_shape(512) == (2, 2, 512, 128)
    with pytest.raises(InvalidArgumentError, match="chunk 3 outside"):
        conv.copy(be.gather, out[:, :, :768], [3], [bare[0]])
    with pytest.raises(KVCacheSDKError, match="region of"):
        conv.copy(be.gather, out, [0], [Region(bare[0].addr, 100)])
    with pytest.raises(KVCacheSDKError, match="misaligned"):
        flat = torch.zeros(2 * 256 * 256 * 2 + 2, dtype=torch.uint8)
        conv.copy(be.scatter, kv, [0], [Region(flat.data_ptr() + 1, 2 * 256 * 256 * 2,
                                               flat[1:-1])])


def test_converter_refuses_a_geometry_that_does_not_hold_the_engine():
    cpu = CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "vec")
    with pytest.raises(KVCacheSDKError, match="does not hold"):
        EngineKVCopy(cpu, _geom(cpu, 192), backend().gather)  # chunk not whole blocks
    with pytest.raises(KVCacheSDKError, match="does not hold"):
        EngineKVCopy(cpu, ChunkGeometry(2, 2, 256, 128, 2), backend().gather)  # two planes
