"""Checks and views shared by the edits: the KV tensor, positions, tokens, query tensors.

Every check raises an :class:`~lmcache_kv_fast.errors.InvalidArgumentError` (or
``InvalidTypeError``) naming the argument, what was expected and what came.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["as_positions", "check_kv", "heads", "split_input", "take_tokens"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_kv(kv: Any, name: str = "kv") -> torch.Tensor:
    """``kv`` as a ``[2, L, T, D]`` floating tensor (K plane 0, V plane 1), or an error."""
    if not isinstance(kv, torch.Tensor):
        raise InvalidTypeError(f"{name}: expected a torch.Tensor [2, L, T, D], got "
                               f"{type(kv).__name__}")
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise InvalidArgumentError(f"{name}: expected the per-token KV [2, L, T, D] (K, V "
                                   f"planes), got shape {tuple(kv.shape)}")
    if kv.dtype not in _FLOATS:
        raise InvalidArgumentError(f"{name}: expected float32, bfloat16 or float16, got "
                                   f"{kv.dtype}")
    return kv


def as_positions(pos: Any, count: int, name: str) -> torch.Tensor:
    """``pos`` as a 1-D int64 CPU tensor of ``count`` non-negative positions."""
    if isinstance(pos, torch.Tensor):
        if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
            raise InvalidArgumentError(f"{name}: expected integer positions, got {pos.dtype}")
        t = pos.detach().to(device="cpu", dtype=torch.int64).reshape(-1) \
            if pos.dim() <= 1 else None
    elif isinstance(pos, Sequence) or hasattr(pos, "__iter__"):
        try:
            t = torch.as_tensor(list(pos), dtype=torch.int64).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgumentError(f"{name}: expected a sequence of ints: {exc}") from exc
    else:
        raise InvalidTypeError(f"{name}: expected a sequence or 1-D tensor of ints, got "
                               f"{type(pos).__name__}")
    if t is None:
        raise InvalidArgumentError(f"{name}: expected a 1-D tensor, got shape {tuple(pos.shape)}")
    if t.numel() != count:
        raise InvalidArgumentError(f"{name}: expected {count} positions (one per token of kv), "
                                   f"got {t.numel()}")
    if count and int(t.min()) < 0:
        raise InvalidArgumentError(f"{name}: positions must be >= 0, got {int(t.min())}")
    return t


def heads(x: torch.Tensor, head_dim: int, name: str) -> torch.Tensor:
    """View ``[..., H*head_dim]`` as ``[..., H, head_dim]`` (an error when it does not divide)."""
    width = x.shape[-1]
    if head_dim <= 0 or width % head_dim:
        raise InvalidArgumentError(f"{name}: last dim {width} is not a whole number of heads "
                                   f"of head_dim={head_dim}")
    return x.unflatten(-1, (width // head_dim, head_dim))


def _kind_name(key: Any) -> str:
    """``"kv"`` / ``"query"`` for an ``LMCacheSDKCacheKind`` or a plain string key."""
    return str(getattr(key, "value", key)).lower()


def split_input(kv: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KV tensor and the query tensor (or None) of an edit's first argument.

    ``batch.rewrite`` passes the KV tensor; a batched stream's ``modify`` passes
    ``{KV: kv, QUERY: q}`` (``LMCacheSDKCacheKind`` keys, matched by value so this package
    need not import ``sdk``).
    """
    if isinstance(kv, Mapping):
        by_name = {_kind_name(k): v for k, v in kv.items()}
        if "kv" not in by_name:
            raise InvalidArgumentError(f"kv: a mapping must hold the KV kind, got keys "
                                       f"{sorted(by_name)}")
        return check_kv(by_name["kv"]), by_name.get("query")
    return check_kv(kv), None


def take_tokens(tokens: Any, idx: torch.Tensor, count: int) -> Any:
    """``tokens`` at ``idx``: a list for a sequence, a tensor for a tensor.

    ``tokens`` must be ``count`` long (one token per KV row).
    """
    n = tokens.numel() if isinstance(tokens, torch.Tensor) else len(tokens)
    if n != count:
        raise InvalidArgumentError(f"tokens: expected {count} tokens (one per KV row), got {n}")
    if isinstance(tokens, torch.Tensor):
        return tokens.reshape(-1).index_select(0, idx.to(tokens.device))
    picked = [tokens[i] for i in idx.tolist()]
    return picked if set(map(type, picked)) <= {int} else [int(t) for t in picked]
