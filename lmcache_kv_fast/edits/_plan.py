"""An edit's rows planned before its KV is read: what a fused rewrite moves slot to slot.

A selection that never reads the KV (``Selection.positional``), given ``rope`` or not,
and a :func:`~lmcache_kv_fast.edits.chain` of such selections come down to one gather of
source rows plus one rotation of each kept key. ``batch.rewrite`` asks :func:`row_plan`
and, when it gets a plan, moves every kept row once from the retrieved slots into the
stored ones (``docs/edits.md``); any other edit runs on a tensor as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.copy.edit_kernels import Rotation
from lmcache_kv_fast.edits._base import Selection
from lmcache_kv_fast.edits._inputs import take_tokens
from lmcache_kv_fast.edits._rerotate import rotation_by
from lmcache_kv_fast.edits._rope import RoPE

__all__ = ["RowPlan", "plannable", "row_plan"]


@dataclass(frozen=True)
class RowPlan:
    """What an edit does to one sequence of ``count`` tokens, without its KV.

    Attributes:
        index: int64 ``[T']``: output row ``j`` is source row ``index[j]``.
        rotation: K's re-rotation per output row (None: rows are copied unchanged).
        tokens: The output's tokens (the given tokens at ``index``).
        rope: The RoPE the rotation follows (None without one).
    """

    index: torch.Tensor
    rotation: Rotation | None
    tokens: Any
    rope: RoPE | None


def _steps(fn: Callable[..., Any]) -> list[Selection] | None:
    """The selections ``fn`` is made of, in order (None: something else is in it)."""
    if isinstance(fn, Selection):
        return [fn]
    inner = getattr(fn, "edits", None)
    if not isinstance(inner, tuple):
        return None
    out: list[Selection] = []
    for e in inner:
        sub = _steps(e)
        if sub is None:
            return None
        out += sub
    return out


def plannable(fn: Callable[..., Any]) -> bool:
    """Whether :func:`row_plan` plans ``fn`` (selections that never read the KV, one RoPE)."""
    steps = _steps(fn)
    if not steps or not all(s.planned for s in steps):
        return False
    ropes = {id(s.rope): s.rope for s in steps if s.rope is not None}
    return len({r for r in ropes.values()}) <= 1


def row_plan(fn: Callable[..., Any], tokens: Sequence[int]) -> RowPlan | None:
    """The :class:`RowPlan` of ``fn`` on ``tokens``, or None when its KV must be read.

    Each step's kept rows index the previous step's output; a step given ``rope`` moves
    its kept keys to ``0 .. n-1``, one without keeps their positions, so the rotation of a
    kept key is ``final position - original position`` (one rotation, equal to the
    chain's to float32 rounding). Steps with different RoPEs are not planned.

    Raises:
        InvalidArgumentError: A step refuses the count (``keep`` past the end), or the
            tokens, as the edit itself would.
    """
    if not plannable(fn):
        return None
    steps = _steps(fn) or []
    ropes = [s.rope for s in steps if s.rope is not None]
    count = len(tokens)
    index = torch.arange(count, dtype=torch.int64)
    position = index.clone()
    for step in steps:
        kept = step.positional(index.numel())
        if kept is None:
            return None
        index, position = index[kept], position[kept]
        if step.rope is not None:
            position = torch.arange(index.numel(), dtype=torch.int64)
    new_tokens = take_tokens(tokens, index, count)
    rope = ropes[0] if ropes else None
    moved = rope is not None and index.numel() and not torch.equal(position, index)
    rotation = rotation_by(position - index, rope) if moved else None  # type: ignore[arg-type]
    return RowPlan(index.contiguous(), rotation, new_tokens, rope)
