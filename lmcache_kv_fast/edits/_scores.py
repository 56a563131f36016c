"""Per-(layer, head) token scores and their aggregation into one score per token.

The cache layout shares one token axis across layers and heads, so a selection keeps one
token set per sequence: every scorer here returns ``[L, H, T]`` and :func:`aggregate`
reduces it over layers and heads (``"mean"`` or ``"max"``, the caller's choice). Higher
means keep. All math is float32, one layer at a time (bounded temporaries), vectorised
over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lmcache_kv_fast.copy import edit_kernels
from lmcache_kv_fast.edits._inputs import heads
from lmcache_kv_fast.errors import InvalidArgumentError

__all__ = ["AGGREGATES", "aggregate", "key_scores", "pool", "redundancy", "window_attention"]

#: How per-(layer, head) scores become one score per token.
AGGREGATES = ("mean", "max")
#: Smallest denominator of a cosine similarity (``F.cosine_similarity``'s default).
_EPS = 1e-8
#: Key rows per block of :func:`redundancy`'s similarity strips.
_RED_BLOCK = 128


def _f32(x: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous float32 copy of ``x``, into ``buf`` (a previous layer's copy) if given.

    A new buffer is the float32 product ``1 * 1`` broadcast to ``x``'s shape, then filled
    by a converting copy: under ``batch.rewrite``'s pooled outputs that product is
    computed straight into a warm pooled buffer. ``x.to(torch.float32)`` (its ``out=``
    form computes into a fresh tensor first), ``torch.empty`` (not pooled) and a
    mixed-dtype ``x * 1`` (the input promoted into a fresh temporary) would each fault
    fresh pages per call.
    """
    if buf is None:
        one = torch.ones(1, dtype=torch.float32)
        buf = torch.mul(one.expand(x.shape), one)
    return buf.copy_(x)


def aggregate(scores: torch.Tensor, how: str, layers: Sequence[int] | None = None
              ) -> torch.Tensor:
    """Reduce ``[L, H, T]`` scores over the chosen layers and all heads to ``[T]``."""
    if layers is not None:
        idx = torch.as_tensor(list(layers), dtype=torch.int64)
        if idx.numel() == 0 or int(idx.min()) < -scores.shape[0] or \
                int(idx.max()) >= scores.shape[0]:
            raise InvalidArgumentError(f"layers: expected indices of the {scores.shape[0]} "
                                       f"layers, got {list(layers)}")
        scores = scores.index_select(0, idx % scores.shape[0])
    flat = scores.reshape(-1, scores.shape[-1])
    if how == "mean":
        return flat.mean(dim=0)
    if how == "max":
        return flat.amax(dim=0)
    raise InvalidArgumentError(f"aggregate: expected one of {list(AGGREGATES)}, got {how!r}")


def key_scores(k: torch.Tensor, head_dim: int, method: str) -> torch.Tensor:
    """Query-free scores from the keys ``[L, T, D]``: ``[L, H, T]``.

    ``"keydiff"`` (Park et al. 2025, KeyDiff): minus the cosine similarity of each key to
    its head's mean key — distinctive keys score high. ``"l2"`` (Devoto et al. 2024): minus
    the key's L2 norm over the head's mean norm — low-norm keys score high, every head on
    the same scale. One float32 copy of a layer's keys, then reductions over head dims
    (in the native core where it takes the keys: the same values to float32 rounding).
    """
    if method not in ("keydiff", "l2"):
        raise InvalidArgumentError(f"score: expected 'keydiff' or 'l2', got {method!r}")
    layers, count = k.shape[0], k.shape[1]
    n_heads = heads(k[:1, :1], head_dim, "kv").shape[-2]
    native = edit_kernels.key_scores(k, head_dim, method)
    if native is not None:
        return native
    # per-layer results go into [L, H, T] buffers: no small temporaries per layer
    norm = torch.empty(layers, n_heads, count)
    ref = torch.empty(layers, n_heads, 1)  # keydiff: dot with the mean key; l2: mean norm
    dot = torch.empty(layers, n_heads, count) if method == "keydiff" else norm
    kh: torch.Tensor | None = None  # one float32 buffer, reused per layer
    for layer in range(layers):
        kh = _f32(heads(k[layer], head_dim, "kv").transpose(0, 1), kh)  # [H, T, Dh]
        torch.linalg.vector_norm(kh, dim=-1, out=norm[layer])
        if method == "keydiff":
            anchor = kh.mean(dim=1, keepdim=True)  # [H, 1, Dh]
            torch.bmm(kh, anchor.transpose(1, 2), out=dot[layer].unsqueeze(-1))
            torch.linalg.vector_norm(anchor, dim=-1, out=ref[layer])
    if method == "keydiff":
        return dot.div_(norm.mul_(ref).clamp_min_(_EPS)).neg_()
    torch.mean(norm, dim=-1, keepdim=True, out=ref)
    return norm.div_(ref.clamp_min_(1e-12)).neg_()


def pool(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """Smooth ``[..., T]`` scores over neighbouring tokens (SnapKV's clustering step)."""
    if kernel <= 1 or x.shape[-1] == 0:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    if how == "max":
        y = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif how == "avg":
        y = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    else:
        raise InvalidArgumentError(f"pooling: expected 'max' or 'avg', got {how!r}")
    return y.reshape(x.shape)


def _queries(q: torch.Tensor, layers: int) -> torch.Tensor:
    """Query tensor as ``[L, Tq, Hq*Dh]`` (qcache's ``[1, L, Tq, Hq*Dh]`` accepted)."""
    if q.dim() == 4 and q.shape[0] == 1:
        q = q[0]
    if q.dim() != 3 or q.shape[0] != layers:
        raise InvalidArgumentError(f"queries: expected [L, Tq, Hq*Dh] or [1, L, Tq, Hq*Dh] "
                                   f"with L={layers} (the KV's layers), got {tuple(q.shape)}")
    return q


def window_attention(q: torch.Tensor, k: torch.Tensor, head_dim: int, window: int, *,
                     at_end: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of the last ``window`` queries to every key, summed over them: ``[L, Hq, T]``.

    GQA: query head ``h`` reads KV head ``h // g`` (``g = Hq / Hkv``, the grouping of
    transformers' ``repeat_kv`` and vLLM). With ``at_end`` the queries are those of the
    KV's last ``Tq`` tokens and each attends causally (keys up to its own position);
    otherwise they come after the KV and see every key.
    """
    q = _queries(q, k.shape[0])
    tq, count = q.shape[1], k.shape[1]
    if window <= 0 or window > tq:
        raise InvalidArgumentError(f"window: expected 1 .. {tq} (the queries given), got "
                                   f"{window}")
    if at_end and tq > count:
        raise InvalidArgumentError(f"queries: {tq} query positions but the KV holds {count} "
                                   f"tokens (queries_at='end' needs Tq <= T)")
    scale = head_dim ** -0.5 if scale is None else scale
    n_q, n_kv = _query_heads(q, k, head_dim)
    # the window's rows only: a small copy when q is a slice (a stream's QUERY tensor)
    native = edit_kernels.window_scores(q[:, tq - window:].contiguous(), k, head_dim, n_kv, window,
                           at_end=at_end, scale=scale)
    return native if native is not None else _window_torch(q, k, head_dim, window, at_end,
                                                           scale, n_q // n_kv)


def _window_torch(q: torch.Tensor, k: torch.Tensor, head_dim: int, window: int,
                  at_end: bool, scale: float, g: int) -> torch.Tensor:
    """:func:`window_attention` in torch (float32 matmuls), one layer at a time."""
    tq, count = q.shape[1], k.shape[1]
    n_kv = k.shape[-1] // head_dim
    n_q = n_kv * g
    # causal mask of the window's queries: only their own window's later keys are hidden
    qpos = torch.arange(window)[:, None]
    mask = torch.arange(window)[None, :] > qpos  # [W, W]
    out = torch.empty(k.shape[0], n_q, count)
    kh: torch.Tensor | None = None  # one float32 buffer, reused per layer
    for layer in range(k.shape[0]):
        qh = heads(q[layer, tq - window:], head_dim, "queries").to(torch.float32)
        qg = qh.reshape(window, n_kv, g, head_dim).permute(1, 2, 0, 3).reshape(
            n_kv, g * window, head_dim)
        kh = _f32(heads(k[layer], head_dim, "kv").transpose(0, 1), kh)  # [Hkv, T, Dh]
        # B as K^T: BLAS reads the transposed operand in place (no copy)
        logits = torch.bmm(qg, kh.transpose(1, 2)).mul_(scale).view(n_kv, g, window, count)
        if at_end:
            logits[..., count - window:].masked_fill_(mask, float("-inf"))
        torch.sum(logits.softmax(dim=-1), dim=2, out=out[layer].view(n_kv, g, count))
    return out


def _query_heads(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> tuple[int, int]:
    """(query heads, KV heads), checked for GQA (``Hq`` a multiple of ``Hkv``)."""
    n_q = heads(q[:1, :1], head_dim, "queries").shape[-2]
    n_kv = heads(k[:1, :1], head_dim, "kv").shape[-2]
    if n_q % n_kv:
        raise InvalidArgumentError(f"queries: {n_q} query heads is not a multiple of the "
                                   f"KV's {n_kv} heads (GQA needs Hq = g * Hkv)")
    return n_q, n_kv


def redundancy(k: torch.Tensor, head_dim: int, threshold: float) -> torch.Tensor:
    """R-KV's redundancy of each key: ``[L, Hkv, T]``, softmax-normalised over tokens.

    Mean cosine similarity of a key to the other keys of its head, counting only pairs
    above ``threshold`` (near-duplicates), then a softmax over tokens as in R-KV's
    reference code, so it sums to 1 like the importance it is weighed against. The
    similarity is symmetric: it is computed in strips of :data:`_RED_BLOCK` rows against
    the keys from the strip on (half the products of the full ``[T, T]`` matrix), each
    strip adding its row sums to its own keys and its column sums to the later ones; no
    ``[H, T, T]`` matrix is ever held. Where the core has AMX or AVX-512 BF16, the sums
    come from :func:`~lmcache_kv_fast.copy.edit_kernels.key_redundancy` (the same values
    to float32 rounding).
    """
    layers, count = k.shape[0], k.shape[1]
    native = edit_kernels.key_redundancy(k, head_dim, threshold)
    if native is not None:
        return torch.softmax(native.div_(count), dim=-1)
    out = torch.empty(layers, k.shape[-1] // head_dim if head_dim > 0 else 0, count)
    raw: torch.Tensor | None = None  # one float32 buffer, reused per layer
    for layer in range(layers):
        raw = _f32(heads(k[layer], head_dim, "kv").transpose(0, 1), raw)
        kh = F.normalize(raw, dim=-1)  # [H, T, Dh]
        acc = torch.zeros(kh.shape[0], count)
        for a0 in range(0, count, _RED_BLOCK):
            a1 = min(count, a0 + _RED_BLOCK)
            sim = torch.bmm(kh[:, a0:a1], kh[:, a0:].transpose(1, 2))  # [H, B, T - a0]
            sim[:, :, :a1 - a0].diagonal(dim1=-2, dim2=-1).zero_()
            F.threshold(sim, threshold, 0.0, inplace=True)
            acc[:, a0:a1] += sim.sum(dim=-1)
            if a1 < count:
                acc[:, a1:] += sim[:, :, a1 - a0:].sum(dim=-2)
        torch.softmax(acc.div_(count), dim=-1, out=out[layer])
    return out
