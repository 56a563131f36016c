"""Helpers that start a real LMCache MP server on loopback for tests, demos and benchmarks.

Only this subpackage may know how the server is launched; the SDK itself never imports
``lmcache``.
"""

from lmcache_kv_fast.testing.register import VllmLikeRegistration, register_vllm_layout
from lmcache_kv_fast.testing.server import (
    QSTORE_MODULE,
    LMCacheServer,
    ServerStartError,
    free_port,
)

__all__ = [
    "QSTORE_MODULE",
    "LMCacheServer",
    "ServerStartError",
    "VllmLikeRegistration",
    "free_port",
    "register_vllm_layout",
]
