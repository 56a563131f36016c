"""Client-side chunk hashes, computed exactly like the server's blake3 hasher (docs/protocol.md §8.1).

The MP server keys every cached chunk by a rolling blake3 hash of the token ids::

    none_hash = blake3(int64_be(0) || uint32_be(0))
    h_0 = blake3(none_hash || pack(">{C}I", tokens[0:C]))
    h_i = blake3(h_{i-1}   || pack(">{C}I", tokens[i*C:(i+1)*C]))

with 32-byte digests and only whole chunks hashed. Salt, model name and shard are not
part of the hash (they are separate key fields). The SDK needs the hashes only to
correlate its own stores with the server's KV events; nothing on the store/retrieve path
depends on them.

``blake3`` is an optional dependency (``pip install blake3``; ``hashlib`` has no blake3).
It is imported on first use; a clear :class:`~lmcache_kv_fast.errors.KVCacheSDKError`
says how to install it when it is missing. The hashes equal the server's only when the
server runs with ``--hash-algorithm blake3`` (its default).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.protocol.constants import CHUNK_HASH_NONE_SEED, MAX_TOKEN_ID

#: The server's hash algorithm these functions reproduce (``/config`` ``mp.hash_algorithm``).
HASH_ALGORITHM = "blake3"

#: Digest size of a chunk hash.
CHUNK_HASH_BYTES = 32

_blake3_module: ModuleType | None = None
_none_hash: bytes | None = None


def require_blake3() -> ModuleType:
    """Import and return the ``blake3`` module.

    Raises:
        KVCacheSDKError: ``blake3`` is not installed (it is an optional dependency).
    """
    global _blake3_module
    if _blake3_module is None:
        try:
            import blake3 as mod
        except ImportError as err:
            raise KVCacheSDKError(
                "chunk hashes need the optional 'blake3' package (the LMCache server hashes "
                "chunks with blake3; hashlib has no blake3): pip install blake3"
            ) from err
        _blake3_module = mod
    return _blake3_module


def blake3_available() -> bool:
    """Return whether :func:`chunk_hashes` can run (``blake3`` importable)."""
    try:
        require_blake3()
    except KVCacheSDKError:
        return False
    return True


def none_hash() -> bytes:
    """Return the chain seed ``blake3(int64_be(0) || uint32_be(0))`` (docs/protocol.md §8.1).

    Raises:
        KVCacheSDKError: ``blake3`` is not installed.
    """
    global _none_hash
    if _none_hash is None:
        _none_hash = require_blake3().blake3(CHUNK_HASH_NONE_SEED).digest()
    return _none_hash


def chunk_hashes(tokens: Sequence[int] | Any, chunk_size: int, *,
                 max_chunks: int | None = None) -> list[bytes]:
    """Return the server's chunk hashes of the whole chunks of ``tokens``.

    Args:
        tokens: Token ids from position 0 (a list/sequence of ints; a trailing partial
            chunk is ignored, like the server does).
        chunk_size: Tokens per chunk of the server (``ctx.chunk_size``).
        max_chunks: Hash at most this many leading chunks (None: all whole chunks).

    Returns:
        One 32-byte digest per whole chunk, in order; ``hashes[i]`` is the key of chunk
        ``i`` and ``hashes[i - 1]`` its parent.

    Raises:
        InvalidArgumentError: ``chunk_size`` is not a positive int, ``max_chunks`` is
            negative, or a token is outside ``[0, 2**32)`` (the server packs ``>I``).
        KVCacheSDKError: ``blake3`` is not installed.
    """
    if type(chunk_size) is not int or chunk_size <= 0:
        raise InvalidArgumentError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if max_chunks is not None and (type(max_chunks) is not int or max_chunks < 0):
        raise InvalidArgumentError(f"max_chunks must be a non-negative int, got {max_chunks!r}")
    n = len(tokens) // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0:
        return []
    b3 = require_blake3().blake3
    prefix = none_hash()
    fmt = struct.Struct(f">{chunk_size}I")
    out: list[bytes] = []
    for i in range(n):
        chunk = tokens[i * chunk_size:(i + 1) * chunk_size]
        try:
            packed = fmt.pack(*chunk)
        except struct.error as err:
            bad = next((t for t in chunk if not isinstance(t, int) or isinstance(t, bool)
                        or not 0 <= t <= MAX_TOKEN_ID), None)
            raise InvalidArgumentError(
                f"tokens must be ints in [0, 2**32) (chunk {i}: {bad!r:.40})"
            ) from err
        h = b3(prefix)
        h.update(packed)
        prefix = h.digest()
        out.append(prefix)
    return out
