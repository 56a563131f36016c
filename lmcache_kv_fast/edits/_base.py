"""The shape every selection edit shares: choose indices, gather them, repair positions.

An edit is called as ``fn(kv, tokens) -> (kv, tokens)`` (``batch.rewrite``,
``store_many`` pipelines) or ``fn({KV: kv, QUERY: q}, tokens)`` (a batched stream's
``modify``). It picks one sorted token set (token order is kept), gathers those rows of K
and V, and — given ``rope`` — re-rotates K so the kept tokens sit at ``0 .. T'-1``, the
positions the engine gives a loaded prefix of ``T'`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_kv_fast.edits._inputs import split_input, take_tokens
from lmcache_kv_fast.edits._rerotate import gather_rerotated
from lmcache_kv_fast.edits._rope import RoPE
from lmcache_kv_fast.errors import InvalidTypeError

__all__ = ["Selection", "chain", "check_rope", "top_tokens"]

EditFn = Callable[[Any, Sequence[int]], tuple[torch.Tensor, Sequence[int]]]


def check_rope(rope: object) -> RoPE | None:
    """``rope`` as given (None or a :class:`RoPE`), else a type error."""
    if rope is not None and not isinstance(rope, RoPE):
        raise InvalidTypeError(f"rope: expected None or an edits.RoPE (rope_from_config), got "
                               f"{type(rope).__name__}")
    return rope


def top_tokens(score: torch.Tensor, n: int, forced: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Sorted indices of the ``n`` best tokens by ``score`` ``[T]``, ``forced`` ones first.

    Forced tokens are always kept, also when there are more of them than ``n`` (a short
    sequence under a ratio). Ties (max pooling makes many) go to the earlier token, so a
    selection is deterministic.
    """
    count = score.shape[0]
    if n >= count:
        return torch.arange(count, dtype=torch.int64)
    s = score.float().clone()
    if forced is not None:
        n = max(n, int(forced.sum()))
        s.masked_fill_(forced, float("inf"))
    order = torch.sort(s, descending=True, stable=True).indices
    return order[:n].sort().values


class Selection:
    """Base of the selection edits: subclasses implement :meth:`indices`."""

    rope: RoPE | None = None

    def indices(self, kv: torch.Tensor, tokens: Sequence[int],
                queries: torch.Tensor | None) -> torch.Tensor:
        """Sorted int64 indices of the tokens to keep (``kv`` is ``[2, L, T, D]``)."""
        raise NotImplementedError

    @property
    def planned(self) -> bool:
        """Whether :meth:`positional` gives the kept indices (the KV is never read)."""
        return False

    def positional(self, count: int) -> torch.Tensor | None:
        """The kept indices when the token count alone decides them, else None.

        A selection that never reads the KV (explicit indices, every k-th, StreamingLLM,
        evenly spaced or seeded-random picks) can be planned before its KV is read, so a
        rewrite moves its rows straight from slot to slot (``edits.row_plan``).
        """
        return None

    def __call__(self, kv: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """Apply the edit: ``(kv, tokens) -> (kept kv, kept tokens)`` (new tensors).

        Raises:
            InvalidArgumentError: Bad shapes (named), or ``len(tokens) != T``.
        """
        kv_t, queries = split_input(kv)
        count = kv_t.shape[2]
        idx = self.indices(kv_t, tokens, queries)
        new_tokens = take_tokens(tokens, idx, count)
        return gather_rerotated(kv_t, idx, self.rope), new_tokens


def chain(*edits: EditFn) -> EditFn:
    """Compose edits left to right: ``chain(a, b)(kv, t) == b(*a(kv, t))``.

    Each selection given ``rope`` leaves the KV at ``0 .. T'-1``, so the next one's
    positions are right; give ``rope`` to every step or to none.
    """
    for e in edits:
        if not callable(e):
            raise InvalidTypeError(f"chain: expected edit functions, got {type(e).__name__}")

    def chained(kv: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, Sequence[int]]:
        out: tuple[Any, Sequence[int]] = (kv, tokens)
        for e in edits:
            out = e(*out)
        return out

    chained.edits = edits  # type: ignore[attr-defined]  # what edits.row_plan composes
    chained.__name__ = "chain(" + ", ".join(getattr(e, "__name__", repr(e)) for e in edits) + ")"
    return chained
