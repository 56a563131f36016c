"""Constants and helpers shared by the engine tests."""

from __future__ import annotations

import random

from lmcache_kv_fast.testing.register import (  # noqa: F401 - re-exported for the tests
    register_engine_driven,
    unregister_engine_driven,
)

BLOCK = 128  # vLLM block size of every engine here
CHUNK = 256  # LMCache chunk size of the server
ENGINE_TEST_TIMEOUT = 1200


def tokens(n: int, seed: int) -> list[int]:
    """``n`` random ids of the tiny vocabulary (3..1023: no bos/eos/unk)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]

