"""Checked access to the fields of the server's ``/status`` JSON (docs/protocol.md §5.2).

Every reader of a ``cache_context_meta`` entry goes through these: a missing or ill-typed
field raises :class:`~lmcache_kv_fast.errors.KVCacheSDKError` naming the field path and
what came.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lmcache_kv_fast.errors import KVCacheSDKError

__all__ = [
    "check_dtype",
    "check_int",
    "check_int_list",
    "check_object",
    "check_str",
    "describe_value",
    "kernel_groups_of",
    "require_key",
]


def describe_value(value: Any) -> str:
    """``repr`` of a received value plus its type, truncated for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def require_key(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    """``mapping[key]``; missing: an error naming ``<where>.<key>`` and the keys that came."""
    if key not in mapping:
        raise KVCacheSDKError(
            f"{where}.{key}: missing (got keys {sorted(mapping)}); the server's /status "
            "does not look like LMCache 0.5.x"
        )
    return mapping[key]


def check_int(value: Any, name: str, *, minimum: int = 0) -> int:
    """``value`` when it is an int (not a bool) ``>= minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise KVCacheSDKError(f"{name}: expected an int >= {minimum}, got {describe_value(value)}")
    return value


def check_str(value: Any, name: str) -> str:
    """``value`` when it is a non-empty str."""
    if not isinstance(value, str) or not value:
        raise KVCacheSDKError(f"{name}: expected a non-empty str, got {describe_value(value)}")
    return value


def check_object(value: Any, name: str) -> Mapping[str, Any]:
    """``value`` when it is a JSON object (a mapping)."""
    if not isinstance(value, Mapping):
        raise KVCacheSDKError(f"{name}: expected an object, got {describe_value(value)}")
    return value


def check_int_list(value: Any, name: str) -> tuple[int, ...]:
    """``value`` (a list of ints ``>= 0``) as a tuple."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise KVCacheSDKError(f"{name}: expected a list of ints >= 0, got {describe_value(value)}")
    return tuple(value)


def check_dtype(value: Any, name: str) -> tuple[str, int]:
    """Validate a ``str(torch.dtype)``; return the bare name and the item size."""
    text = check_str(value, name)
    bare = text.removeprefix("torch.")
    dtype = getattr(torch, bare, None)
    if not isinstance(dtype, torch.dtype):
        raise KVCacheSDKError(
            f"{name}: expected a torch dtype name like 'torch.bfloat16', got {describe_value(value)}"
        )
    return str(dtype).removeprefix("torch."), dtype.itemsize



def kernel_groups_of(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Return the validated ``kv_cache_layout.kernel_groups`` list of an entry.

    Args:
        entry: One ``cache_context_meta`` value.

    Returns:
        The kernel-group objects, in order (at least one).

    Raises:
        KVCacheSDKError: The entry, its ``kv_cache_layout`` or ``kernel_groups`` is
            missing, ill-typed or empty.

    """
    entry = check_object(entry, "cache_context_meta entry")
    layout = check_object(
        require_key(entry, "kv_cache_layout", "entry"), "entry.kv_cache_layout"
    )
    groups = require_key(layout, "kernel_groups", "entry.kv_cache_layout")
    if not isinstance(groups, list) or not groups:
        raise KVCacheSDKError(
            "entry.kv_cache_layout.kernel_groups: expected a non-empty list, got "
            f"{describe_value(groups)}"
        )
    return [
        check_object(kg, f"entry.kv_cache_layout.kernel_groups[{i}]") for i, kg in enumerate(groups)
    ]
