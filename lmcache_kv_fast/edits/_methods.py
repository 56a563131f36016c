"""Public constructors of the scored edits (keep_ratio, keep_budget, key_norm, snapkv, rkv)."""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_kv_fast.edits._base import check_rope
from lmcache_kv_fast.edits._rope import RoPE
from lmcache_kv_fast.edits._scored import (
    RKV,
    KeyScored,
    QuerySource,
    ScoreFn,
    SnapKV,
    check_amount,
    check_window_args,
    make_key_scored,
    resolve_head_dim,
)
from lmcache_kv_fast.errors import InvalidArgumentError

__all__ = ["keep_budget", "keep_ratio", "key_norm", "rkv", "snapkv"]


def keep_ratio(r: float, score: str | ScoreFn = "keydiff", *, aggregate: str = "mean",
               sinks: int = 0, recent: int = 0, head_dim: int | None = None,
               layers: Sequence[int] | None = None, seed: int = 0,
               rope: RoPE | None = None) -> KeyScored:
    """Edit keeping ``ceil(r * T)`` tokens chosen by ``score``.

    Args:
        r: Fraction kept, in (0, 1].
        score: ``"keydiff"`` (default), ``"l2"``, ``"uniform"`` (evenly spaced),
            ``"random"`` (seeded), or ``fn(kv, tokens) -> [T] | [L, H, T]`` (higher keeps).
        aggregate: ``"mean"`` or ``"max"`` over layers and heads.
        sinks: First tokens always kept.
        recent: Last tokens always kept.
        head_dim: Head size (default ``rope.head_dim``); key scores need one.
        layers: Layers whose scores count (default all).
        seed: Seed of ``"random"``.
        rope: Re-rotate the kept keys to ``0 .. T'-1`` when given.
    """
    return make_key_scored(r, None, score, "keep_ratio", aggregate=aggregate, sinks=sinks,
                           recent=recent, head_dim=head_dim, layers=layers, seed=seed, rope=rope)


def keep_budget(n: int, score: str | ScoreFn = "keydiff", *, aggregate: str = "mean",
                sinks: int = 0, recent: int = 0, head_dim: int | None = None,
                layers: Sequence[int] | None = None, seed: int = 0,
                rope: RoPE | None = None) -> KeyScored:
    """Edit keeping ``min(n, T)`` tokens chosen by ``score`` (arguments as :func:`keep_ratio`)."""
    return make_key_scored(None, n, score, "keep_budget", aggregate=aggregate, sinks=sinks,
                           recent=recent, head_dim=head_dim, layers=layers, seed=seed, rope=rope)


def key_norm(ratio: float | None = None, budget: int | None = None, *,
             method: str = "keydiff", aggregate: str = "mean", sinks: int = 0,
             recent: int = 0, head_dim: int | None = None,
             layers: Sequence[int] | None = None, rope: RoPE | None = None) -> KeyScored:
    """Query-free key scoring: KeyDiff (Park et al. 2025) or low L2 norm (Devoto et al. 2024).

    ``method="keydiff"`` keeps the keys least similar (cosine) to their head's mean key;
    ``method="l2"`` keeps the lowest-norm keys. Give ``ratio`` or ``budget``; other
    arguments as :func:`keep_ratio`.
    """
    if method not in ("keydiff", "l2"):
        raise InvalidArgumentError(f"key_norm: method must be 'keydiff' or 'l2', got {method!r}")
    return make_key_scored(ratio, budget, method, "key_norm", aggregate=aggregate, sinks=sinks,
                           recent=recent, head_dim=head_dim, layers=layers, rope=rope)


def snapkv(queries: QuerySource = None, window: int = 32, kernel: int = 7, *,
           ratio: float | None = None, budget: int | None = None, pooling: str = "max",
           aggregate: str = "mean", queries_at: str = "end", head_dim: int | None = None,
           layers: Sequence[int] | None = None, scale: float | None = None,
           rope: RoPE | None = None) -> SnapKV:
    """SnapKV (Li et al. 2024): keep the tokens the observation window attends to most.

    Args:
        queries: ``[L, Tq, Hq*Dh]`` or qcache's ``[1, L, Tq, Hq*Dh]`` (post-RoPE, as the
            engine's attention sees them), or ``queries(tokens) -> tensor`` per sequence,
            or None: the QUERY tensor of a batched stream's ``modify`` (a prompt's
            queries from its first token: its first ``T`` rows are used, fewer refused).
        window: Observation window: the last ``window`` queries (all of them when fewer);
            with ``queries_at="end"`` those tokens are always kept, also beyond a ratio.
        kernel: Odd pooling width over tokens (SnapKV's clustering; 1 = none).
        ratio: Fraction of tokens kept (window included), or
        budget: Tokens kept (window included).
        pooling: ``"max"`` (SnapKV's default) or ``"avg"``.
        aggregate: ``"mean"`` or ``"max"`` over query heads and layers.
        queries_at: ``"end"``: the queries are the KV's last ``Tq`` tokens (causal);
            ``"after"``: they follow the KV (every key visible, nothing forced).
        head_dim: Head size of K and Q (default ``rope.head_dim``).
        layers: Layers whose scores count (default all).
        scale: Attention scale (default ``head_dim ** -0.5``).
        rope: Re-rotate the kept keys to ``0 .. T'-1`` when given.
    """
    check_amount(ratio, budget, "snapkv")
    check_window_args(window, kernel, pooling, queries_at, aggregate, "snapkv", budget)
    resolve_head_dim(head_dim, rope, "snapkv")
    return SnapKV(queries=queries, window=window, kernel=kernel, ratio=ratio, budget=budget,
                  pooling=pooling, aggregate=aggregate, queries_at=queries_at,
                  head_dim=head_dim, layers=layers, scale=scale, rope=check_rope(rope))


def rkv(queries: QuerySource = None, window: int = 8, kernel: int = 7, *,
        ratio: float | None = None, budget: int | None = None, lam: float = 0.1,
        threshold: float = 0.5, pooling: str = "max", aggregate: str = "mean",
        queries_at: str = "end", head_dim: int | None = None,
        layers: Sequence[int] | None = None, scale: float | None = None,
        rope: RoPE | None = None) -> RKV:
    """R-KV (Cai et al. 2025): importance minus redundancy.

    Importance is SnapKV's pooled window attention averaged over the window and over each
    KV head's query group; redundancy is a key's mean cosine similarity to the other keys
    of its head above ``threshold``, softmax-normalised; the score is
    ``lam * importance - (1 - lam) * redundancy``. Other arguments as :func:`snapkv`.
    """
    check_amount(ratio, budget, "rkv")
    check_window_args(window, kernel, pooling, queries_at, aggregate, "rkv", budget)
    resolve_head_dim(head_dim, rope, "rkv")
    if not 0.0 <= lam <= 1.0:
        raise InvalidArgumentError(f"rkv: lam must be in [0, 1], got {lam!r}")
    if not -1.0 <= threshold < 1.0:
        raise InvalidArgumentError(f"rkv: threshold must be in [-1, 1), got {threshold!r}")
    return RKV(queries=queries, window=window, kernel=kernel, ratio=ratio, budget=budget,
               pooling=pooling, aggregate=aggregate, queries_at=queries_at,
               head_dim=head_dim, layers=layers, scale=scale, rope=check_rope(rope),
               lam=float(lam), threshold=float(threshold))
