"""``fused_blocks`` keeps each engine geometry's checked tables and plans across calls.

A call with the block tables of an earlier one reuses that call's checks and copy plans
(csrc/fused_blocks.cpp ``tables()``), counted by ``copy_stats()["fused_block_tables"]``:
planned once per geometry, path (lane groups on / forced off) and rotation shape, and the
bytes moved are the torch backend's whichever plan was kept. Refused tables are never kept
(``test_fused_blocks.py::test_core_refuses_before_anything_is_written`` runs bad tables
after good ones of the same geometry). No server needed.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy import torch_backend as tb
from lmcache_kv_fast.copy.base import ChunkGeometry, Region
from lmcache_kv_fast.layout import CpuEngineKV

HEAD_DIM, BLOCK, CHUNK, LAYERS, SOURCES = 64, 32, 64, 2, 3
#: Heads of the geometries only test_a_geometry_is_planned_once_per_order and
#: test_forcing_the_portable_path_plans_anew use (xdist may run the other tests of this
#: file first in the same worker), and of the others.
FIRST_HEADS, ISA_HEADS, HEADS = 5, 7, 3


def _planned() -> int:
    return _native.copy_stats()["fused_block_tables"]


def _geom(heads: int) -> ChunkGeometry:
    return ChunkGeometry(1, LAYERS, CHUNK, heads * 2 * HEAD_DIM, 2)


def _call(backend: object, kernel: str, srcs: list[torch.Tensor], heads: int
          ) -> list[torch.Tensor]:
    """Drop every 10th token of ``srcs`` (bfloat16) into fresh chunks; return them."""
    geom = _geom(heads)
    engine = CpuEngineKV(LAYERS, heads, HEAD_DIM, torch.bfloat16, BLOCK, kernel)
    plan = edits.row_plan(edits.drop_every(10), list(range(SOURCES * CHUNK)))
    assert plan is not None
    ids = list(range(plan.index.numel() // CHUNK))
    dsts = [torch.zeros(geom.object_shape(), dtype=torch.bfloat16) for _ in ids]
    backend.fused_blocks([Region.of_tensor(s) for s in srcs], ids,  # type: ignore[attr-defined]
                         [Region.of_tensor(d) for d in dsts], plan.index, geom, engine)
    return dsts


def _sources(seed: int, heads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(_geom(heads).object_shape(), generator=gen).to(torch.bfloat16)
            for _ in range(SOURCES)]


def _assert_as_reference(kernel: str, seed: int, heads: int = HEADS) -> None:
    srcs = _sources(seed, heads)
    got, want = _call(nb, kernel, srcs, heads), _call(tb, kernel, srcs, heads)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), kernel


def test_a_geometry_is_planned_once_per_order() -> None:
    before = _planned()
    _assert_as_reference("vec", 1, FIRST_HEADS)
    assert _planned() == before + 1
    _assert_as_reference("vec", 2, FIRST_HEADS)
    assert _planned() == before + 1  # the same tables: kept
    _assert_as_reference("amx", 3, FIRST_HEADS)  # other tables: planned
    assert _planned() == before + 2


def test_kept_plans_of_several_orders_move_the_reference_bytes() -> None:
    """Orders alternating call after call: each call gets its own geometry's plan."""
    for seed in range(3):
        for kernel in ("vec", "amx", "vec16"):
            _assert_as_reference(kernel, seed)


@pytest.mark.skipif(_native.fused_blocks_isa() != "avx512", reason="no AVX-512BW here")
def test_forcing_the_portable_path_plans_anew() -> None:
    _assert_as_reference("vec16", 4, ISA_HEADS)  # planned with lane groups
    before = _planned()
    _native._set_fused_blocks_isa("generic")
    try:
        _assert_as_reference("vec16", 5, ISA_HEADS)
        assert _planned() == before + 1  # not the lane groups' plan: one without them
    finally:
        _native._set_fused_blocks_isa("auto")
    _assert_as_reference("vec16", 6, ISA_HEADS)
    assert _planned() == before + 1  # the lane groups' plan was kept
