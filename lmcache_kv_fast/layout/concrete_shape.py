"""The ``engine_kv_concrete_shape`` string of a kernel group (docs/protocol.md §6.2).

:func:`parse_concrete_shape` reads ``"4 x [2, 64, 16, 8, 128]"`` into list levels and
inner dims; :func:`match_template` checks them against a format's symbolic shape.
"""

from __future__ import annotations

import re

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.formats import LITERAL_LABELS, FormatSpec
from lmcache_kv_fast.layout.status_fields import describe_value

__all__ = ["UNKNOWN_PREFIX", "match_template", "parse_concrete_shape"]

#: How the server prints a format it has no concrete shape for: ``"Unknown (...)"``.
UNKNOWN_PREFIX = "Unknown ("
_LEVEL_RE = re.compile(r"^(?:\d+|[A-Za-z_]\w*)$")


def parse_concrete_shape(text: str) -> tuple[tuple[int | str, ...], tuple[int, ...]]:
    """Parse an ``engine_kv_concrete_shape`` string (docs/protocol.md §6.2).

    The innermost tensor is the text inside the **last** ``[...]``; what precedes it
    are list levels joined by ``" x "``. Numeric levels become ints; symbolic ones
    (``NP``) stay strings.

    Args:
        text: For example ``"4 x [2, 64, 16, 8, 128]"``, ``"2 x 3 x [112, 4, 64]"``,
            ``"3 x NP x [7, 16, 1, 576]"`` or ``"[7, 3, 2, 16, 4, 64]"`` (cross-layer).

    Returns:
        ``(list_levels, inner_dims)``, e.g. ``((4,), (2, 64, 16, 8, 128))``.

    Raises:
        KVCacheSDKError: ``text`` is not a str, is an ``"Unknown (...)"`` placeholder,
            or is not of the form above.

    """
    if not isinstance(text, str):
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape: expected a str, got {describe_value(text)}"
        )
    stripped = text.strip()
    if stripped.startswith(UNKNOWN_PREFIX):
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape is {text!r}: the server prints no concrete shape "
            "for this format; the geometry must come from cache_size_per_token"
        )
    close = stripped.rfind("]")
    opening = stripped.rfind("[", 0, close) if close >= 0 else -1
    if opening < 0 or stripped[close + 1 :].strip():
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape {text!r}: expected '[d0, d1, ...]' optionally "
            "preceded by list levels joined with ' x '"
        )
    try:
        inner = tuple(int(part) for part in stripped[opening + 1 : close].split(","))
    except ValueError:
        raise KVCacheSDKError(
            f"engine_kv_concrete_shape {text!r}: the innermost dims are not all integers"
        ) from None
    if any(d < 0 for d in inner):
        raise KVCacheSDKError(f"engine_kv_concrete_shape {text!r}: negative dimension")

    prefix = stripped[:opening].strip()
    levels: list[int | str] = []
    if prefix:
        if not prefix.endswith("x"):
            raise KVCacheSDKError(
                f"engine_kv_concrete_shape {text!r}: list levels must be joined with ' x '"
            )
        for part in (p.strip() for p in prefix[:-1].split(" x ")):
            if not _LEVEL_RE.match(part):
                raise KVCacheSDKError(
                    f"engine_kv_concrete_shape {text!r}: bad list level {part!r}"
                )
            levels.append(int(part) if part.isdigit() else part)
    return tuple(levels), inner



def match_template(
    spec: FormatSpec,
    levels: tuple[int | str, ...],
    inner: tuple[int, ...],
    text: str,
    where: str,
) -> None:
    """Check a parsed concrete shape against the format's symbolic shape."""
    bad = (
        f"{where}.engine_kv_concrete_shape {text!r} does not fit {spec.name} "
        f"({spec.symbolic_shape})"
    )
    if len(levels) != len(spec.list_levels) or len(inner) != len(spec.inner_dims):
        raise KVCacheSDKError(bad)
    for got, label in zip(levels, spec.list_levels, strict=True):
        if label == "NP":
            ok = got == "NP" or (isinstance(got, int) and got >= 1)
        elif label in LITERAL_LABELS:
            ok = got == int(label)
        else:
            ok = isinstance(got, int)
        if not ok:
            raise KVCacheSDKError(f"{bad}: list level {label} is {got!r}")
    for i, (got_dim, label) in enumerate(zip(inner, spec.inner_dims, strict=True)):
        if label in LITERAL_LABELS and label != "NP" and got_dim != int(label):
            raise KVCacheSDKError(f"{bad}: dim {i} ({label}) is {got_dim}")
        if label not in LITERAL_LABELS and got_dim < 1:
            raise KVCacheSDKError(f"{bad}: dim {i} ({label}) is {got_dim}")
