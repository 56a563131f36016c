"""Cache keys in the dialect of a server generation (docs/protocol.md §4.1)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from lmcache_kv_fast.protocol.ops import Generation
from lmcache_kv_fast.protocol.types import CacheKey, IPCCacheServerKey, PackedTokensKey

__all__ = ["make_key", "pack_tokens", "token_list"]

_SWAP = sys.byteorder == "little"


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as 0.5.7's ``token_bytes``: big-endian uint32 each (ids are < 2**32)."""
    a = array("I", tokens)
    if a.itemsize != 4:  # pragma: no cover - every platform torch supports has 4-byte int
        a = array("L", tokens)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def token_list(key: CacheKey) -> list[int]:
    """The token ids of a key of either dialect."""
    if isinstance(key, IPCCacheServerKey):
        return list(key.token_ids)
    a = array("I")
    a.frombytes(key.token_bytes)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def make_key(gen: Generation, *, model_name: str, world_size: int, worker_id: int | None,
             tokens: Sequence[int], start: int, end: int, request_id: str,
             cache_salt: str = "", request_configs: dict | None = None,
             num_kv_readers: int = 1) -> CacheKey:
    """The wire key of ``tokens[start:end]`` for a server of generation ``gen``."""
    if gen.token_bytes_keys:
        return PackedTokensKey(
            model_name=model_name, world_size=world_size, worker_id=worker_id,
            token_bytes=pack_tokens(tokens), start=start, end=end, request_id=request_id,
            cache_salt=cache_salt, request_configs=request_configs,
            num_kv_readers=num_kv_readers)
    return IPCCacheServerKey(
        model_name=model_name, world_size=world_size, worker_id=worker_id,
        token_ids=list(tokens) if not isinstance(tokens, list) else tokens, start=start,
        end=end, request_id=request_id, cache_salt=cache_salt,
        request_configs=request_configs, num_kv_readers=num_kv_readers)
