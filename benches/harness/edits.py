"""W3's and W7's edit functions (what ``batch.rewrite`` and the sequential loops apply).

:data:`EDITS` maps ``--w3-edit`` to the function. Each takes ``(kv, tokens, k, *,
alloc=None)`` and returns the edited ``(kv, tokens)``. W7's plain-torch SnapKV with
re-rotation (:func:`snapkv_rerotate_plain`) is what upstream's loop applies. Torch is
imported where needed: the worker interpreters import this module.
"""

from __future__ import annotations

import math
import time
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


def plain_loop(ctx: Any, prompts: Sequence[Sequence[int]],
               fn: Callable[..., tuple[Any, list[int]]], stages: dict[str, float]) -> int:
    """``retrieve -> fn -> store`` per prompt (either SDK's context); sequences stored.

    Each stage's seconds are added into ``stages`` (``retrieve``, ``fn``, ``store``).
    """
    ok = 0
    for toks in prompts:
        t0 = time.perf_counter()
        kv = ctx.retrieve(toks)
        t1 = time.perf_counter()
        if kv is None:
            continue
        new_kv, new_toks = fn(kv, toks)
        del kv
        t2 = time.perf_counter()
        ok += bool(ctx.store(new_kv, new_toks))
        del new_kv
        t3 = time.perf_counter()
        for k, v in (("retrieve", t1 - t0), ("fn", t2 - t1), ("store", t3 - t2)):
            stages[k] = stages.get(k, 0.0) + v
    return ok


def dropped_tokens(tokens: Sequence[int], k: int) -> list[int]:
    """``tokens`` without tokens ``k-1, 2k-1, ...`` (what every W3 edit keeps)."""
    return [tok for i, tok in enumerate(tokens) if i % k != k - 1]


# ---------------------------------------------------------------------------- W3F
#: A Llama-3-8B-style ``config.json`` (Llama 3.1 8B's attention and RoPE): head_dim 128, so
#: 8 KV heads in W3's D = 1024; llama3 frequency bands. W3F's fused drop re-rotates with it.
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def llama3_8b_rope() -> dict[str, float]:
    """:data:`LLAMA3_8B_CONFIG`'s RoPE in :func:`llama3_inv_freq`'s form."""
    sc = LLAMA3_8B_CONFIG["rope_scaling"]
    return {"rope_theta": LLAMA3_8B_CONFIG["rope_theta"], "factor": sc["factor"],
            "low_freq_factor": sc["low_freq_factor"], "high_freq_factor": sc["high_freq_factor"],
            "original_max_position_embeddings": sc["original_max_position_embeddings"],
            "head_dim": LLAMA3_8B_CONFIG["head_dim"]}


def rerotate_plain(k: Any, delta: Any, inv_freq: Any) -> Any:
    """Keys ``k`` ``[L, T, D]`` rotated by ``delta[t]`` positions, in plain torch (float32).

    ``rotate_half`` RoPE over heads of ``2 * len(inv_freq)``; rounded back to ``k``'s dtype.
    """
    import torch

    head_dim = 2 * inv_freq.numel()
    layers, count, width = k.shape
    angle = delta.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angle.cos()] * 2, -1)[:, None]
    sin = torch.cat([angle.sin()] * 2, -1)[:, None]
    x = k.float().view(layers, count, width // head_dim, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).view(layers, count, width).to(k.dtype)


# ---------------------------------------------------------------------------- W7
#: Llama-3.2-1B's RoPE (``config.json``): what W7's edit re-rotates with.
LLAMA32_1B_ROPE = {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                   "head_dim": 64}
#: Llama-3.2-1B's attention heads (W7's queries: ``[L, window, 32 * 64]``).
LLAMA32_1B_QUERY_HEADS = 32


def llama3_inv_freq(rope: dict[str, float]) -> Any:
    """Llama 3's band-scaled RoPE frequencies, written out as a user copies them."""
    import torch

    dim = int(rope["head_dim"])
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def w7_queries(layers: int, window: int, seed: int = 7) -> Any:
    """W7's given queries: random, fixed by ``seed``, ``[L, window, 32 * 64]`` bf16."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    width = LLAMA32_1B_QUERY_HEADS * int(LLAMA32_1B_ROPE["head_dim"])
    return torch.randn(layers, window, width, generator=gen).to(torch.bfloat16)


def snapkv_rerotate_plain(kv: Any, tokens: Sequence[int], queries: Any, inv_freq: Any, *,
                          window: int = 32, kernel: int = 7, ratio: float = 0.5,
                          head_dim: int = 64) -> tuple[Any, list[int]]:
    """W7's edit in plain torch, as a user writes it after SnapKV's reference code.

    Per layer: repeat the KV heads for the query groups, the window's causal attention
    (softmax over keys, summed over the window), max-pooled votes averaged over heads and
    layers; keep the top ``ceil(ratio * T) - window`` tokens plus the window, gather them
    (a fresh tensor), then re-rotate the kept keys to ``0 .. T'-1`` with ``rotate_half``.
    """
    import torch
    import torch.nn.functional as F

    layers, count, width = kv.shape[1], kv.shape[2], kv.shape[3]
    n_kv = width // head_dim
    votes = torch.zeros(count - window)
    mask = torch.arange(count)[None, :] > torch.arange(count - window, count)[:, None]
    for layer in range(layers):
        q = queries[layer, -window:].float().view(window, -1, head_dim).transpose(0, 1)
        k = kv[0, layer].float().view(count, n_kv, head_dim).transpose(0, 1)
        k = k.repeat_interleave(q.shape[0] // n_kv, dim=0)  # repeat_kv
        att = (q @ k.transpose(1, 2)) / math.sqrt(head_dim)  # [Hq, W, T]
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1).sum(dim=1)
        pooled = F.max_pool1d(att[:, None, : count - window], kernel, 1, kernel // 2)
        votes += pooled[:, 0].mean(dim=0)
    n = max(0, math.ceil(ratio * count) - window)
    top = votes.topk(min(n, count - window)).indices.sort().values
    keep = torch.cat([top, torch.arange(count - window, count)])
    out = kv[:, :, keep]
    angle = (torch.arange(len(keep)) - keep).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    k = out[0].float().view(layers, len(keep), n_kv, head_dim)
    half = head_dim // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    out[0] = (k * cos + rotated * sin).view(layers, len(keep), width).to(kv.dtype)
    return out, [tokens[i] for i in keep.tolist()]


#: ``--w3-edit`` choices (the first is the default).
EDITS: dict[str, Callable[..., tuple[Any, list[int]]]] = {
    "view": drop_every_kth,
    "index_select": drop_every_kth_index_select,
}
