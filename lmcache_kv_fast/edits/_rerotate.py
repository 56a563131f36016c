"""Re-rotate cached keys from their old positions to new ones.

RoPE rotates each pair of a key's rotary dims by ``position * freq``; rotations of one
plane compose, so ``R(new) R(old)^-1 = R(new - old)`` per frequency. A key cached at
``old`` therefore becomes the key the model would have computed at ``new`` by one rotation
of the difference — for every variant whose frequencies do not depend on the position
(default, ``linear``, ``llama3``, ``yarn``; ``dynamic`` under its documented frequency
assumption). Magnitude factors the engine applies to cos/sin (``yarn``'s mscale) are
already in the cached keys and are kept: the difference is a pure rotation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_kv_fast.copy.edit_kernels import Rotation, gather_tokens
from lmcache_kv_fast.copy.rotate_pairs import rotate_pairs
from lmcache_kv_fast.edits._inputs import as_positions, check_kv, heads
from lmcache_kv_fast.edits._rope import RoPE
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["gather_rerotated", "rerotate", "rotation_by"]


def _check_rope(rope: object) -> RoPE:
    """``rope`` as a :class:`RoPE`, or an error saying how to get one."""
    if rope is None:
        raise InvalidArgumentError(
            "rope: re-rotation needs the model's RoPE (edits.rope_from_config(config)); a "
            "model without RoPE has nothing to re-rotate: do not ask for it")
    if not isinstance(rope, RoPE):
        raise InvalidTypeError(f"rope: expected an edits.RoPE (rope_from_config), got "
                               f"{type(rope).__name__}")
    return rope


#: Elements of one fp32 temporary of :func:`_rotate_chunks` (512 KiB: cache-sized, and
#: few enough ops that the per-op cost of a dispatch mode stays small).
_CHUNK_ELEMS = 1 << 17


def _cos_sin(delta: torch.Tensor, rope: RoPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``delta * inv_freq`` ``[T, 1, rotary_dim/2]`` (float64 angles)."""
    angle = delta.to(torch.float64)[:, None] * rope.inv_freq().to(torch.float64)[None, :]
    return angle.cos().to(torch.float32)[:, None, :], angle.sin().to(torch.float32)[:, None, :]


def _rotate_chunks(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RoPE) -> None:
    """Rotate the rotary dims of ``k`` ``[L, T, H, head_dim]`` in place (fp32 math).

    Each pair ``(x1, x2)`` (neox: dims ``i, i + rotary_dim/2``; interleaved: ``2i, 2i+1``)
    becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``: the complex product ``(x1 + i x2)
    e^{i angle}``. Token slices across all layers at once, so every temporary stays
    cache-sized and the cos/sin tables are computed once.
    """
    layers, count, n_heads, _ = k.shape
    half = rope.rotary_dim // 2
    step = max(1, _CHUNK_ELEMS // max(1, layers * n_heads * half))
    for t0 in range(0, count, step):
        x = k[:, t0:t0 + step]
        if rope.interleaved:
            x1, x2 = x[..., 0:rope.rotary_dim:2], x[..., 1:rope.rotary_dim:2]
        else:
            x1, x2 = x[..., :half], x[..., half:rope.rotary_dim]
        rotate_pairs(x1, x2, cos[t0:t0 + step], sin[t0:t0 + step])


def rerotate(kv: torch.Tensor, old_positions: Sequence[int] | torch.Tensor, rope: RoPE,
             new_positions: Sequence[int] | torch.Tensor | None = None, *,
             inplace: bool = False) -> torch.Tensor:
    """Move cached K from each token's old position to its new one; V is untouched.

    Args:
        kv: Per-token KV ``[2, L, T', D]``, ``D = num_kv_heads * head_dim``, K after RoPE
            (plane 0), V (plane 1); float32, bfloat16 or float16.
        old_positions: Position each row's K was rotated at (``T'`` ints).
        rope: The model's :class:`RoPE` (:func:`rope_from_config`).
        new_positions: Target positions (default ``0 .. T'-1``: where the engine puts a
            loaded prefix).
        inplace: Rotate ``kv`` itself (a view of contiguous heads) instead of a copy.

    Returns:
        A new tensor (or ``kv`` when ``inplace``) with K rotated by ``new - old`` (computed
        in float32 from float64 angles, cast back to ``kv``'s dtype) and V bit-identical.

    Raises:
        InvalidArgumentError: No RoPE, a KV that is not ``[2, L, T', D]``, ``D`` not a
            multiple of ``rope.head_dim``, positions of the wrong count or negative.
    """
    rope = _check_rope(rope)
    kv = check_kv(kv)
    _, _, count, width = kv.shape
    if width % rope.head_dim:
        raise InvalidArgumentError(f"kv: last dim {width} is not a whole number of heads of "
                                   f"rope.head_dim={rope.head_dim}")
    old = as_positions(old_positions, count, "old_positions")
    new = torch.arange(count, dtype=torch.int64) if new_positions is None else \
        as_positions(new_positions, count, "new_positions")
    out = kv if inplace else kv.clone()
    if count == 0 or bool(torch.equal(old, new)):
        return out
    cos, sin = _cos_sin(new - old, rope)
    try:
        k_heads = heads(out[0], rope.head_dim, "kv")
    except RuntimeError as exc:
        raise InvalidArgumentError(f"kv: inplace re-rotation needs rows whose heads can be "
                                   f"viewed (contiguous last dim): {exc}") from exc
    _rotate_chunks(k_heads, cos, sin, rope)
    return out


def rotation_by(delta: torch.Tensor, rope: RoPE) -> Rotation:
    """The native core's :class:`Rotation` turning each row by ``delta`` positions."""
    cos, sin = _cos_sin(delta, rope)
    return Rotation(cos[:, 0].contiguous(), sin[:, 0].contiguous(), rope.head_dim,
                    rope.rotary_dim, rope.interleaved)


def gather_rerotated(kv: torch.Tensor, idx: torch.Tensor, rope: RoPE | None) -> torch.Tensor:
    """``kv.index_select(2, idx)``, K re-rotated to ``0 .. n-1`` when ``rope`` is given.

    One native pass (gather and rotation together) where the core takes the tensors,
    else torch's gather and :func:`rerotate` in place: the same values up to float32
    rounding order. ``idx`` holds valid indices (the selection's own).
    """
    rotation = None
    if rope is not None and idx.numel():
        rotation = rotation_by(torch.arange(idx.numel(), dtype=torch.int64) - idx, rope)
    wide = kv.dim() == 4 and (rope is None or kv.shape[-1] % rope.head_dim == 0)
    out = gather_tokens(kv, idx, rotation) if wide else None
    if out is not None:
        return out
    out = kv.index_select(2, idx.to(kv.device))
    if rope is not None and idx.numel():
        rerotate(out, idx, rope, inplace=True)
    return out
