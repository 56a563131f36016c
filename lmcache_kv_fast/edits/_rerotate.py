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

from lmcache_kv_fast.edits._inputs import as_positions, check_kv, heads
from lmcache_kv_fast.edits._rope import RoPE
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["rerotate"]


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


def _rotate_plane(k: torch.Tensor, rot: torch.Tensor, rope: RoPE) -> None:
    """Rotate the rotary dims of ``k`` ``[T, H, head_dim]`` in place (fp32 math).

    Each pair becomes one complex number (real: first member, imaginary: second) and is
    multiplied by ``rot`` ``[T, 1, rotary_dim/2]`` (``exp(i * angle)``): one float32 copy
    in, one multiply, one cast back.
    """
    half = rope.rotary_dim // 2
    x = k[..., :rope.rotary_dim]
    # pairs on the last axis: (2i, 2i+1) interleaved, (i, i+half) neox
    pairs = x.unflatten(-1, (half, 2)) if rope.interleaved else \
        x.unflatten(-1, (2, half)).transpose(-1, -2)
    z = torch.view_as_complex(pairs.to(torch.float32, memory_format=torch.contiguous_format)
                              .contiguous())
    z.mul_(rot)
    pairs.copy_(torch.view_as_real(z))


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
        in float32, angles in float64, cast back to ``kv``'s dtype) and V bit-identical.

    Raises:
        InvalidArgumentError: No RoPE, a KV that is not ``[2, L, T', D]``, ``D`` not a
            multiple of ``rope.head_dim``, positions of the wrong count or negative.
    """
    rope = _check_rope(rope)
    kv = check_kv(kv)
    _, layers, count, width = kv.shape
    if width % rope.head_dim:
        raise InvalidArgumentError(f"kv: last dim {width} is not a whole number of heads of "
                                   f"rope.head_dim={rope.head_dim}")
    old = as_positions(old_positions, count, "old_positions")
    new = torch.arange(count, dtype=torch.int64) if new_positions is None else \
        as_positions(new_positions, count, "new_positions")
    out = kv if inplace else kv.clone()
    if count == 0 or bool(torch.equal(old, new)):
        return out
    angle = (new - old).to(torch.float64)[:, None] * rope.inv_freq().to(torch.float64)[None, :]
    rot = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)[:, None, :]
    try:
        k_heads = heads(out[0], rope.head_dim, "kv")
    except RuntimeError as exc:
        raise InvalidArgumentError(f"kv: inplace re-rotation needs rows whose heads can be "
                                   f"viewed (contiguous last dim): {exc}") from exc
    for layer in range(layers):
        _rotate_plane(k_heads[layer], rot, rope)
    return out
