"""What the fused kernels' tests share (test_fused_rows.py, test_fused_blocks.py).

Token indices of every shape the kernels must take, the K rotation for an index, the
output chunks a call writes, and destinations filled with a sentinel byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_kv_fast import edits
from lmcache_kv_fast.copy.edit_kernels import Rotation
from lmcache_kv_fast.edits._rerotate import _cos_sin

SENTINEL = 0x5A  # every destination byte before a call


@dataclass(frozen=True)
class Slot:
    """A segment slot for ``regions()``."""

    offset: int
    length: int


def token_index(kind: str, rows: int, block_size: int = 0, seed: int = 0) -> torch.Tensor:
    """Source row of every output row, of ``rows`` source rows.

    ``drop10`` every 10th dropped; ``keep`` a random sorted 2/3; ``dups`` repeats in any
    order; ``shift`` every row from 5 on (each output chunk straddles two sources);
    ``same`` every row where it was; ``pairs`` two of every 20 dropped (even shifts);
    ``block`` the second engine block of ``block_size`` rows dropped.
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "drop10":
        idx = [t for t in range(rows) if t % 10 != 9]
    elif kind == "keep":
        idx = sorted(torch.randperm(rows, generator=gen)[: rows * 2 // 3].tolist())
    elif kind == "dups":
        idx = torch.randint(0, rows, (rows * 3 // 4,), generator=gen).tolist()
    elif kind == "shift":
        idx = list(range(5, rows))
    elif kind == "same":
        idx = list(range(rows))
    elif kind == "pairs":
        idx = [t for t in range(rows) if t % 20 < 18]
    elif kind == "block":
        idx = [t for t in range(rows) if not block_size <= t < 2 * block_size]
    else:
        raise AssertionError(f"unknown index kind {kind!r}")
    return torch.tensor(idx, dtype=torch.int64)


def rotation_for(rope: edits.RoPE | None, idx: torch.Tensor) -> Rotation | None:
    """K's rotation moving each output row from its source position to its own."""
    if rope is None:
        return None
    cos, sin = _cos_sin(torch.arange(idx.numel(), dtype=torch.int64) - idx, rope)
    return Rotation(cos[:, 0].contiguous(), sin[:, 0].contiguous(), rope.head_dim,
                    rope.rotary_dim, rope.interleaved)


def chunk_ids(chunk: int, n_out: int, subset: bool) -> list[int]:
    """Every whole output chunk, or (``subset``) half of them in a shuffled order."""
    ids = list(range(n_out // chunk))
    if subset:
        gen = torch.Generator().manual_seed(7)
        ids = [ids[i] for i in torch.randperm(len(ids), generator=gen).tolist()]
        ids = ids[: max(1, len(ids) // 2)]
    return ids


def blank(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A destination whose every byte is :data:`SENTINEL`."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(SENTINEL)
    return t
