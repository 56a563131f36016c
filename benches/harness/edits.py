"""W3's edit functions (what ``batch.rewrite`` and the sequential loops apply).

:data:`EDITS` maps ``--w3-edit`` to the function. Each takes ``(kv, tokens, k, *,
alloc=None)`` and returns the edited ``(kv, tokens)``. Torch is imported where needed:
the worker interpreters import this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def drop_every_kth(kv: Any, tokens: Sequence[int], k: int = 10, *,
                   alloc: Callable[..., Any] | None = None) -> tuple[Any, list[int]]:
    """Drop tokens ``k-1, 2k-1, ...`` of ``kv`` (dim -2) and ``tokens``: W3's edit.

    The same result as ``lmcache_kv_fast.demo.drop_every_kth``, as one strided copy: the
    first ``T // k * k`` tokens viewed as ``[..., T // k, k, D]`` minus the last of each
    group, then the tail. ``index_select`` along dim -2 (the demo's way) costs ~10x more and
    is erratic on a loaded machine, which would make W3 measure torch instead of the SDKs.
    The output comes from ``alloc(shape, dtype)`` when given (``batch.rewrite``'s pool of
    warm buffers), else from ``torch.empty`` (fresh pages, as a plain loop gets them).
    """
    import torch

    t = kv.shape[-2]
    full = t // k * k
    groups = full // k
    shape = (*kv.shape[:-2], t - t // k, kv.shape[-1])
    out = alloc(shape, kv.dtype) if alloc is not None else torch.empty(shape, dtype=kv.dtype)
    head = kv.narrow(-2, 0, full).unflatten(-2, (groups, k)).narrow(-2, 0, k - 1)
    out.narrow(-2, 0, groups * (k - 1)).unflatten(-2, (groups, k - 1)).copy_(head)
    out.narrow(-2, groups * (k - 1), t - full).copy_(kv.narrow(-2, full, t - full))
    return out, [tok for i, tok in enumerate(tokens) if (i + 1) % k]


def drop_every_kth_index_select(kv: Any, tokens: Sequence[int], k: int = 10, *,
                                alloc: Callable[..., Any] | None = None
                                ) -> tuple[Any, list[int]]:
    """``lmcache_kv_fast.demo.drop_every_kth`` (``--w3-edit index_select``), ``alloc`` as above."""
    import torch

    keep = [i for i in range(len(tokens)) if (i + 1) % k != 0]
    index = torch.tensor(keep, dtype=torch.long)
    if alloc is None:
        return kv.index_select(-2, index).contiguous(), [tokens[i] for i in keep]
    out = alloc((*kv.shape[:-2], len(keep), kv.shape[-1]), kv.dtype)
    return torch.index_select(kv, -2, index, out=out), [tokens[i] for i in keep]


def drop_every_kth_plain(kv: Any, tokens: Sequence[int], k: int = 10) -> tuple[Any, list[int]]:
    """W3P's edit: the plain function users write (issue 24), verbatim for ``k == 10``.

    ``keep = [i for i in range(len(tokens)) if i % 10 != 9]``;
    ``return kv.index_select(2, torch.tensor(keep)), [tokens[i] for i in keep]`` -- a fresh
    output per call, no ``alloc`` (so ``batch.rewrite`` sees a two-argument function).
    """
    import torch

    keep = [i for i in range(len(tokens)) if i % k != k - 1]
    return kv.index_select(2, torch.tensor(keep)), [tokens[i] for i in keep]


#: ``--w3-edit`` choices (the first is the default).
EDITS: dict[str, Callable[..., tuple[Any, list[int]]]] = {
    "view": drop_every_kth,
    "index_select": drop_every_kth_index_select,
}
