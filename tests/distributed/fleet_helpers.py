"""Edits and helpers shipped to Ray actors (pickled by value: tests are not importable there)."""

from __future__ import annotations

import time

import torch


def drop_every_4th(kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Drop every 4th token (an in-order, position-based, deterministic edit)."""
    keep = [i for i in range(len(tokens)) if i % 4 != 3]
    idx = torch.tensor(keep, dtype=torch.long)
    return kv.index_select(-2, idx).contiguous(), [tokens[i] for i in keep]


def drop_every_4th_alloc(kv, tokens, *, alloc):
    """The same edit written into ``alloc``'s reused buffers."""
    keep = [i for i in range(len(tokens)) if i % 4 != 3]
    idx = torch.tensor(keep, dtype=torch.long)
    shape = list(kv.shape)
    shape[-2] = len(keep)
    out = alloc(shape, kv.dtype)
    torch.index_select(kv, kv.dim() - 2, idx, out=out)
    return out, [tokens[i] for i in keep]


class SlowDrop:
    """``drop_every_4th`` that takes ``delay`` seconds (keeps items in flight for fault tests)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        time.sleep(self.delay)
        return drop_every_4th(kv, tokens)


def whole(tokens: list[int], chunk: int) -> list[int]:
    return tokens[: len(tokens) // chunk * chunk]
