"""Selections by score: key scores (KeyDiff, L2), SnapKV, R-KV; ratio or budget.

Scores are computed per (layer, head) and aggregated to one score per token
(:func:`~lmcache_kv_fast.edits._scores.aggregate`, ``"mean"`` or ``"max"``); the best
tokens are kept in token order. Attention-sink and recent tokens can be protected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_kv_fast.copy.edit_kernels import pool_scores
from lmcache_kv_fast.edits._base import Selection, check_rope, top_tokens
from lmcache_kv_fast.edits._rope import RoPE
from lmcache_kv_fast.edits._scores import (
    AGGREGATES,
    aggregate,
    key_scores,
    pool,
    redundancy,
    window_attention,
)
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["RKV", "KeyScored", "SnapKV", "count_kept", "resolve_head_dim"]

ScoreFn = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
QuerySource = torch.Tensor | Callable[[Sequence[int]], torch.Tensor] | None
#: Named scores of :func:`keep_ratio` / :func:`keep_budget`.
SCORES = ("keydiff", "l2", "uniform", "random")


def resolve_head_dim(head_dim: int | None, rope: RoPE | None, what: str) -> int:
    """The head size from ``head_dim`` or ``rope`` (an error naming ``what`` needs it)."""
    hd = head_dim if head_dim is not None else (rope.head_dim if rope is not None else None)
    if hd is None or isinstance(hd, bool) or not isinstance(hd, int) or hd <= 0:
        raise InvalidArgumentError(f"{what}: needs the head size to split D into heads: pass "
                                   f"head_dim= or rope= (got head_dim={head_dim!r})")
    return hd


def count_kept(count: int, ratio: float | None, budget: int | None) -> int:
    """Tokens to keep of ``count``: ``ceil(ratio * count)`` or ``min(budget, count)``."""
    if budget is not None:
        return min(budget, count)
    assert ratio is not None
    return min(count, max(1, math.ceil(ratio * count)))


def check_amount(ratio: float | None, budget: int | None, what: str) -> None:
    """Exactly one of ``ratio`` in (0, 1] and ``budget`` >= 1."""
    if (ratio is None) == (budget is None):
        raise InvalidArgumentError(f"{what}: give exactly one of ratio= and budget=")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise InvalidArgumentError(f"{what}: ratio must be in (0, 1], got {ratio!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise InvalidArgumentError(f"{what}: budget must be an int >= 1, got {budget!r}")


def check_choice(value: str, choices: Sequence[str], name: str) -> None:
    """``value`` is one of ``choices`` (an error naming both otherwise)."""
    if value not in choices:
        raise InvalidArgumentError(f"{name}: expected one of {list(choices)}, got {value!r}")


def _protected(count: int, sinks: int, recent: int) -> torch.Tensor | None:
    """Mask of the first ``sinks`` and last ``recent`` tokens (None when both are 0)."""
    if not (sinks or recent):
        return None
    i = torch.arange(count)
    return (i < sinks) | (i >= count - recent)


def _uniform(count: int, n: int, forced: torch.Tensor | None) -> torch.Tensor:
    """``n`` evenly spaced tokens (the forced ones included)."""
    if n >= count:
        return torch.arange(count, dtype=torch.int64)
    forced = torch.zeros(count, dtype=torch.bool) if forced is None else forced
    free = torch.nonzero(~forced).flatten()
    m = max(n - int(forced.sum()), 0)
    pick = free[torch.div(torch.arange(m) * free.numel(), max(m, 1), rounding_mode="floor")]
    return torch.cat([torch.nonzero(forced).flatten(), pick]).sort().values


@dataclass(frozen=True, eq=False)
class KeyScored(Selection):
    """Keep a ratio / budget of tokens by a query-free score (see :func:`keep_ratio`)."""

    ratio: float | None
    budget: int | None
    score: str | ScoreFn
    aggregate: str = "mean"
    sinks: int = 0
    recent: int = 0
    head_dim: int | None = None
    layers: Sequence[int] | None = None
    seed: int = 0
    rope: RoPE | None = None

    @property
    def planned(self) -> bool:
        return self.score in ("uniform", "random")

    def positional(self, count: int) -> torch.Tensor | None:
        if not self.planned:
            return None
        n = count_kept(count, self.ratio, self.budget)
        forced = _protected(count, self.sinks, self.recent)
        if self.score == "uniform":
            return _uniform(count, n, forced)
        gen = torch.Generator().manual_seed(self.seed)
        return top_tokens(torch.rand(count, generator=gen), n, forced)

    def indices(self, kv: torch.Tensor, tokens: Sequence[int],
                queries: torch.Tensor | None) -> torch.Tensor:
        count = kv.shape[2]
        planned = self.positional(count)
        if planned is not None:
            return planned
        n = count_kept(count, self.ratio, self.budget)
        forced = _protected(count, self.sinks, self.recent)
        if callable(self.score):
            s = self.score(kv, tokens)
            if not isinstance(s, torch.Tensor) or s.shape[-1] != count or s.dim() not in (1, 3):
                raise InvalidArgumentError(f"score: the callable must return [T] or [L, H, T] "
                                           f"with T={count}, got {getattr(s, 'shape', s)!r}")
            s = aggregate(s.float(), self.aggregate, self.layers) if s.dim() == 3 else s
        else:
            hd = resolve_head_dim(self.head_dim, self.rope, f"score={self.score!r}")
            s = aggregate(key_scores(kv[0], hd, self.score), self.aggregate, self.layers)
        return top_tokens(s, n, forced)


def make_key_scored(ratio: float | None, budget: int | None, score: str | ScoreFn,
                    what: str, **kw: Any) -> KeyScored:
    """Validate and build a :class:`KeyScored` edit."""
    check_amount(ratio, budget, what)
    if not callable(score):
        check_choice(score, SCORES, "score")
        if score in ("keydiff", "l2"):
            resolve_head_dim(kw.get("head_dim"), kw.get("rope"), f"{what}(score={score!r})")
    check_choice(kw.get("aggregate", "mean"), AGGREGATES, "aggregate")
    for name in ("sinks", "recent"):
        v = kw.get(name, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidArgumentError(f"{what}: {name} must be an int >= 0, got {v!r}")
    always = kw.get("sinks", 0) + kw.get("recent", 0)
    if budget is not None and budget < always:
        raise InvalidArgumentError(f"{what}: budget {budget} cannot hold the {always} tokens "
                                   f"always kept (sinks + recent)")
    check_rope(kw.get("rope"))
    return KeyScored(ratio=ratio, budget=budget, score=score, **kw)


def resolve_queries(source: QuerySource, given: torch.Tensor | None,
                    tokens: Sequence[int], what: str) -> torch.Tensor:
    """The query tensor: the edit's own, its callable's answer, or the stream's QUERY."""
    q = source(tokens) if callable(source) else source
    q = given if q is None else q
    if q is None:
        raise InvalidArgumentError(f"{what}: no query tensors: pass queries= (a tensor or "
                                   f"queries(tokens) -> tensor) or run it in a batched stream "
                                   f"with a QUERY context")
    if not isinstance(q, torch.Tensor):
        raise InvalidTypeError(f"{what}: queries must be a torch.Tensor, got {type(q).__name__}")
    return q


def stream_queries(q: torch.Tensor, count: int, queries_at: str, what: str) -> torch.Tensor:
    """A batched stream's QUERY tensor cut to the queries of the KV's ``count`` tokens.

    A QUERY context reads a prompt's queries from its first token (qcache: position ``i``
    is token ``i``), while the edit's ``queries_at="end"`` takes a tensor's last rows as
    the KV's last tokens: the two agree only on the KV's own ``count`` rows. Fewer rows
    than the KV cannot hold its observation window, so they are refused, never shifted.
    """
    if queries_at != "end":
        raise InvalidArgumentError(f"{what}: queries_at={queries_at!r} with the stream's QUERY "
                                   f"tensor: it holds the queries of the KV's own tokens, use "
                                   f"queries_at='end'")
    tq = q.shape[-2] if q.dim() >= 2 else 0
    if tq < count:
        raise InvalidArgumentError(f"{what}: the stream's QUERY tensor covers {tq} tokens but "
                                   f"the KV {count}: the observation window must be the KV's "
                                   f"last tokens (the engine stored fewer queries than KV)")
    return q[..., :count, :]


@dataclass(frozen=True, eq=False)
class SnapKV(Selection):
    """SnapKV (Li et al. 2024): keep what the observation window attends to, plus the window."""

    queries: QuerySource = field(repr=False)
    window: int
    kernel: int
    ratio: float | None
    budget: int | None
    pooling: str = "max"
    aggregate: str = "mean"
    queries_at: str = "end"
    head_dim: int | None = None
    layers: Sequence[int] | None = None
    scale: float | None = None
    rope: RoPE | None = None

    def _attention(self, kv: torch.Tensor, tokens: Sequence[int],
                   queries: torch.Tensor | None, what: str) -> tuple[torch.Tensor, int, int]:
        """Window attention ``[L, Hq, T]`` summed over the window; forced and used window.

        Fewer queries than ``window`` (a short prompt) make the window that short.
        """
        q = resolve_queries(self.queries, queries, tokens, what)
        if self.queries is None:  # the stream's QUERY tensor, aligned at token 0
            q = stream_queries(q, kv.shape[2], self.queries_at, what)
        hd = resolve_head_dim(self.head_dim, self.rope, what)
        at_end = self.queries_at == "end"
        window = min(self.window, q.shape[-2]) if q.dim() >= 2 else self.window
        att = window_attention(q, kv[0], hd, window, at_end=at_end, scale=self.scale)
        return att, (window if at_end else 0), window

    def _pooled(self, att: torch.Tensor, window: int) -> torch.Tensor:
        """``att`` pooled over the tokens before the window; the window's scores zeroed."""
        prefix = att.shape[-1] - window
        if self.kernel > 1 and not pool_scores(att, prefix, self.kernel, self.pooling):
            for layer in range(att.shape[0]):  # per layer: small temporaries, reused heap
                att[layer, :, :prefix] = pool(att[layer, :, :prefix], self.kernel,
                                              self.pooling)
        att[..., prefix:] = 0
        return att

    def indices(self, kv: torch.Tensor, tokens: Sequence[int],
                queries: torch.Tensor | None) -> torch.Tensor:
        count = kv.shape[2]
        att, w, _ = self._attention(kv, tokens, queries, "snapkv")
        forced = _protected(count, 0, w)
        return top_tokens(aggregate(self._pooled(att, w), self.aggregate, self.layers),
                          count_kept(count, self.ratio, self.budget), forced)


@dataclass(frozen=True, eq=False)
class RKV(SnapKV):
    """R-KV (Cai et al. 2025): window-attention importance minus key redundancy."""

    lam: float = 0.1
    threshold: float = 0.5

    def indices(self, kv: torch.Tensor, tokens: Sequence[int],
                queries: torch.Tensor | None) -> torch.Tensor:
        count = kv.shape[2]
        att, w, used = self._attention(kv, tokens, queries, "rkv")
        hd = resolve_head_dim(self.head_dim, self.rope, "rkv")
        red = redundancy(kv[0], hd, self.threshold)  # [L, Hkv, T]
        n_kv = red.shape[1]
        # R-KV's order: mean over the window and the query group, then pool
        imp = self._pooled(att.view(att.shape[0], n_kv, -1, count).mean(dim=2) / used, w)
        score = self.lam * imp - (1 - self.lam) * red
        forced = _protected(count, 0, w)
        return top_tokens(aggregate(score, self.aggregate, self.layers),
                          count_kept(count, self.ratio, self.budget), forced)


def check_window_args(window: int, kernel: int, pooling: str, queries_at: str,
                      aggregate_: str, what: str, budget: int | None = None) -> None:
    """Validate the observation-window arguments of :func:`snapkv` / :func:`rkv`."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidArgumentError(f"{what}: window must be an int >= 1, got {window!r}")
    if budget is not None and queries_at == "end" and budget < window:
        raise InvalidArgumentError(f"{what}: budget {budget} cannot hold the window of "
                                   f"{window} tokens it always keeps")
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise InvalidArgumentError(f"{what}: kernel must be an odd int >= 1 (a centred pool), "
                                   f"got {kernel!r}")
    check_choice(pooling, ("max", "avg"), "pooling")
    check_choice(queries_at, ("end", "after"), "queries_at")
    check_choice(aggregate_, AGGREGATES, "aggregate")
