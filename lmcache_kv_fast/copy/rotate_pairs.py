"""RoPE pair rotation in torch: the rounding order every torch re-rotation shares.

``(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)`` in float32: ``mul``, then ``addcmul_``. The
native kernels (``csrc/rope_rotate.cpp``) round in the same order, so their bytes equal
this code's.
"""

from __future__ import annotations

import torch

__all__ = ["rotate_pairs"]


def rotate_pairs(x1: torch.Tensor, x2: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
    """Rotate the pair views ``x1``, ``x2`` in place by ``c``, ``s`` (broadcast)."""
    a = x1.to(torch.float32)
    b = x2.to(torch.float32)
    n1 = a * c
    n1.addcmul_(b, s, value=-1.0)
    b.mul_(c).addcmul_(a, s)
    x1.copy_(n1)
    x2.copy_(b)
