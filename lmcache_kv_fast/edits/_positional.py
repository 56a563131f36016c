"""Selections by position only: explicit indices, every k-th dropped, StreamingLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache_kv_fast.edits._base import Selection, check_rope
from lmcache_kv_fast.edits._rope import RoPE
from lmcache_kv_fast.errors import InvalidArgumentError

__all__ = ["DropEvery", "Keep", "Positional", "StreamingLLM", "drop_every", "keep", "streaming_llm"]


class Positional(Selection):
    """A selection by position only: its kept indices come from the token count."""

    def indices(self, kv: torch.Tensor, tokens: Sequence[int],
                queries: torch.Tensor | None) -> torch.Tensor:
        return self.positional(kv.shape[2])

    @property
    def planned(self) -> bool:
        return True

    def positional(self, count: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class Keep(Positional):
    """Keep the given token indices (sorted on construction; duplicates refused)."""

    index: torch.Tensor = field(repr=False)
    rope: RoPE | None = None

    def positional(self, count: int) -> torch.Tensor:
        if self.index.numel() and int(self.index[-1]) >= count:
            raise InvalidArgumentError(f"keep: index {int(self.index[-1])} is out of range for "
                                       f"{count} tokens")
        return self.index


def keep(indices: Sequence[int] | torch.Tensor, rope: RoPE | None = None) -> Keep:
    """Edit keeping exactly ``indices`` (in token order), re-rotated when ``rope`` is given."""
    try:
        idx = torch.as_tensor(indices if isinstance(indices, torch.Tensor) else list(indices),
                              dtype=torch.int64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(f"keep: expected a sequence of ints: {exc}") from exc
    idx = idx.sort().values
    if idx.numel() and int(idx[0]) < 0:
        raise InvalidArgumentError(f"keep: indices must be >= 0, got {int(idx[0])}")
    if idx.numel() > 1 and bool((idx[1:] == idx[:-1]).any()):
        raise InvalidArgumentError("keep: duplicate indices (each token is kept once)")
    return Keep(index=idx, rope=check_rope(rope))


@dataclass(frozen=True)
class DropEvery(Positional):
    """Drop tokens ``k-1, 2k-1, ...`` (every k-th), keep the rest."""

    k: int
    rope: RoPE | None = None

    def positional(self, count: int) -> torch.Tensor:
        i = torch.arange(count, dtype=torch.int64)
        return i[i % self.k != self.k - 1]


def drop_every(k: int, rope: RoPE | None = None) -> DropEvery:
    """Edit dropping every ``k``-th token (``k >= 2``), re-rotated when ``rope`` is given."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise InvalidArgumentError(f"drop_every: expected an int k >= 2, got {k!r}")
    return DropEvery(k=k, rope=check_rope(rope))


@dataclass(frozen=True)
class StreamingLLM(Positional):
    """Keep the first ``sinks`` and the last ``window`` tokens (Xiao et al. 2023)."""

    sinks: int
    window: int
    rope: RoPE | None = None

    def positional(self, count: int) -> torch.Tensor:
        i = torch.arange(count, dtype=torch.int64)
        return i[(i < self.sinks) | (i >= count - self.window)]


def streaming_llm(sinks: int, window: int, rope: RoPE | None = None) -> StreamingLLM:
    """Edit keeping ``sinks`` attention-sink tokens and a recent ``window`` (StreamingLLM).

    The paper assigns positions within the cache, i.e. re-rotates: pass ``rope``.
    """
    for name, v in (("sinks", sinks), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidArgumentError(f"streaming_llm: {name} must be an int >= 0, got {v!r}")
    if sinks + window == 0:
        raise InvalidArgumentError("streaming_llm: sinks + window must keep at least one token")
    return StreamingLLM(sinks=sinks, window=window, rope=check_rope(rope))
