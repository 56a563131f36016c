"""The native core's edit kernels: a token gather with RoPE re-rotation, window attention.

The selection edits (:mod:`lmcache_kv_fast.edits`) call these when the native backend is
live and the tensors suit the core (CPU, contiguous, bfloat16 or float32 KV, bfloat16
queries); otherwise each returns None and the edit runs its torch code, which computes
the same values. Results live in the result pool (:func:`alloc_result`), so an edit that
runs per sequence reuses already-faulted memory. ``csrc/rope_gather.cpp`` and
``csrc/window_scores.cpp`` say what is computed and how.

The dot products of :func:`window_scores` and :func:`key_redundancy` are fast in the core
only on AMX or AVX512-BF16 (:func:`window_scores_isa`); elsewhere the core's portable loop
is several times slower than torch's matmul, so these decline and the edit runs torch,
unless asked for that loop (``window_scores(..., portable=True)``: the tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from lmcache_kv_fast.copy.select import backend

__all__ = ["Rotation", "gather_tokens", "key_redundancy", "key_scores", "pool_scores",
           "window_scores", "window_scores_isa"]

_KV_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


class Rotation(NamedTuple):
    """How :func:`gather_tokens` turns plane 0's rotary pairs: per kept row ``j``.

    Attributes:
        cos: float32 ``[n, rotary_dim / 2]``, contiguous.
        sin: float32 ``[n, rotary_dim / 2]``, contiguous.
        head_dim: Elements per head.
        rotary_dim: Rotated elements at the start of each head (even, <= ``head_dim``).
        interleaved: Pairs ``(2i, 2i+1)`` instead of neox's ``(i, i + rotary_dim/2)``.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    head_dim: int
    rotary_dim: int
    interleaved: bool


def _native() -> object | None:
    be = backend()
    return getattr(be, "_native", None) if be.NAME == "native" else None


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(buffer address, buffer bytes, view offset)`` of ``t`` (nothing for no elements)."""
    if t.numel() == 0:
        return 0, 0, 0
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes(), t.data_ptr() - st.data_ptr()


def _dense(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous() and \
        t.layout == torch.strided and not t.is_conj() and not t.is_neg()


def gather_tokens(kv: torch.Tensor, idx: torch.Tensor,
                  rotation: Rotation | None = None) -> torch.Tensor | None:
    """``kv.index_select(2, idx)`` with plane 0 re-rotated, in one native pass; or None.

    Args:
        kv: ``[planes, L, T, D]``, contiguous, bfloat16 or float32.
        idx: int64 ``[n]``, every entry in ``[0, T)`` (checked by the core).
        rotation: The rotation of each kept row's K, or None for a plain gather.

    Returns:
        A new ``[planes, L, n, D]`` tensor, or None when the core cannot run this call.
    """
    native = _native()
    if native is None or kv.dim() != 4 or kv.dtype not in _KV_DTYPES or not _dense(kv) or \
            idx.dtype != torch.int64 or idx.dim() != 1 or not _dense(idx):
        return None
    planes, layers, rows, width = kv.shape
    n = idx.numel()
    out = backend().alloc_result((planes, layers, n, width), kv.dtype)
    empty = torch.empty(0, dtype=torch.float32)
    cos, sin = (rotation.cos, rotation.sin) if rotation is not None else (empty, empty)
    native.rope_gather(  # type: ignore[attr-defined]
        _span(out), _span(kv), _span(idx), _span(cos), _span(sin), planes, layers, rows, n,
        width, rotation.head_dim if rotation else 0, rotation.rotary_dim if rotation else 0,
        bool(rotation and rotation.interleaved), _KV_DTYPES[kv.dtype])
    return out


def window_scores(q: torch.Tensor, k: torch.Tensor, head_dim: int, n_kv: int, window: int,
                  *, at_end: bool, scale: float, portable: bool = False
                  ) -> torch.Tensor | None:
    """Window attention summed over the window, ``[L, Hq, T]`` float32; or None.

    Args:
        q: bfloat16 ``[L, Tq, Hq * head_dim]``, contiguous; its last ``window`` rows are
            the window's queries.
        k: bfloat16 ``[L, T, n_kv * head_dim]``, contiguous (plane 0 of the KV).
        head_dim: Elements per head.
        n_kv: KV heads (``Hq`` must be a multiple: GQA).
        window: Queries in the window (1 .. Tq).
        at_end: The queries are the KV's last tokens (causal within the window).
        scale: Logit scale (> 0).
        portable: Run the core's portable loop too, where it has no fast path for this
            head size (slower than torch: for tests of that loop).

    Returns:
        The scores, or None when the core cannot run this call (dtypes, layout, backend)
        or has only its portable loop for it and ``portable`` is False.
    """
    native = _native()
    if native is None or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or \
            q.dim() != 3 or k.dim() != 3 or not (_dense(q) and _dense(k)) or \
            not (scale > 0) or n_kv <= 0 or head_dim <= 0 or k.shape[2] != n_kv * head_dim or \
            q.shape[2] % (n_kv * head_dim):
        return None
    if not portable and \
            native.window_scores_isa(head_dim) == "generic":  # type: ignore[attr-defined]
        return None
    layers, count = k.shape[0], k.shape[1]
    group = q.shape[2] // (n_kv * head_dim)
    out = backend().alloc_result((layers, n_kv * group, count), torch.float32)
    native.window_scores(  # type: ignore[attr-defined]
        _span(q), _span(k), _span(out), layers, count, q.shape[1], n_kv, group, head_dim,
        window, at_end, float(scale))
    return out


def pool_scores(x: torch.Tensor, n: int, kernel: int, how: str) -> bool:
    """Pool the first ``n`` scores of every row of ``x`` ``[..., T]`` in place (SnapKV).

    Each becomes the max (``how="max"``) or mean (``"avg"``) of the scores within
    ``kernel // 2`` positions, positions past the row's first ``n`` not counting.

    Returns:
        True when done; False when the core cannot run it (not contiguous float32 on
        CPU, no native backend): nothing was changed.
    """
    native = _native()
    if native is None or x.dtype != torch.float32 or not _dense(x) or x.dim() < 1 or \
            not 0 <= n <= x.shape[-1] or how not in ("max", "avg"):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    native.score_pool(_span(x), rows, n, x.shape[-1], kernel,  # type: ignore[attr-defined]
                      how == "max")
    return True


def key_scores(k: torch.Tensor, head_dim: int, method: str) -> torch.Tensor | None:
    """KeyDiff (``"keydiff"``) or L2 (``"l2"``) scores ``[L, Hkv, T]`` float32; or None.

    Args:
        k: bfloat16 ``[L, T, Hkv * head_dim]``, contiguous (plane 0 of the KV).
        head_dim: Elements per head.
        method: ``"keydiff"`` or ``"l2"``.

    Returns:
        The scores (see ``edits._scores.key_scores``), or None when the core cannot run
        this call.
    """
    native = _native()
    if native is None or k.dtype != torch.bfloat16 or k.dim() != 3 or not _dense(k) or \
            head_dim <= 0 or k.shape[2] % head_dim or method not in ("keydiff", "l2"):
        return None
    layers, count, n_kv = k.shape[0], k.shape[1], k.shape[2] // head_dim
    out = backend().alloc_result((layers, n_kv, count), torch.float32)
    native.key_scores(_span(k), _span(out), layers, count, n_kv,  # type: ignore[attr-defined]
                      head_dim, method == "keydiff")
    return out


def key_redundancy(k: torch.Tensor, head_dim: int, threshold: float) -> torch.Tensor | None:
    """R-KV's redundancy sums ``[L, Hkv, T]`` float32 (AMX or AVX512-BF16); or None.

    ``out[l, h, i]`` = the sum of ``cos(k_i, k_j)`` over the other keys ``j`` of head
    ``h`` whose cosine exceeds ``threshold``; the caller takes the mean and the softmax.

    Args:
        k: bfloat16 ``[L, T, Hkv * head_dim]``, contiguous (plane 0 of the KV).
        head_dim: Elements per head.
        threshold: Cosines at or below it do not count.

    Returns:
        The sums, or None when the core cannot run this call fast (neither AMX nor
        AVX512-BF16, or an isa forced below them; head size, dtype): it has no portable
        loop.
    """
    native = _native()
    if native is None or k.dtype != torch.bfloat16 or k.dim() != 3 or not _dense(k) or \
            head_dim <= 0 or k.shape[2] % head_dim or \
            not native.key_redundancy_supported(head_dim):  # type: ignore[attr-defined]
        return None
    layers, count, n_kv = k.shape[0], k.shape[1], k.shape[2] // head_dim
    out = backend().alloc_result((layers, n_kv, count), torch.float32)
    native.key_redundancy(_span(k), _span(out), layers, count, n_kv,  # type: ignore[attr-defined]
                          head_dim, float(threshold))
    return out


def window_scores_isa(head_dim: int | None = None) -> str:
    """The path of :func:`window_scores`' dot products here.

    Args:
        head_dim: Elements per head, or None for the fastest path this CPU runs (and the
            isa forced by ``_native._set_window_scores_isa`` allows).

    Returns:
        ``"amx"``, ``"avx512"`` (AVX512-BF16), ``"generic"`` (the core's portable loop,
        which :func:`window_scores` declines unless ``portable``), or ``"torch"`` (no
        native core).
    """
    native = _native()
    if native is None:
        return "torch"
    return native.window_scores_isa(head_dim)  # type: ignore[attr-defined]
