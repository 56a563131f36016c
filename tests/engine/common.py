"""Constants and helpers shared by the engine tests."""

from __future__ import annotations

import random

from engine_fixtures import BLOCK, CHUNK, ENGINE_TEST_TIMEOUT

from lmcache_kv_fast.testing.register import (
    register_engine_driven,
    unregister_engine_driven,
)

__all__ = ["BLOCK", "CHUNK", "ENGINE_TEST_TIMEOUT", "register_engine_driven", "tokens",
           "unregister_engine_driven"]


def tokens(n: int, seed: int) -> list[int]:
    """``n`` random ids of the tiny vocabulary (3..1023: no bos/eos/unk)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]

