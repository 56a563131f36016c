"""The cache kinds of the 0.5.6 SDK: which tensor family a context moves.

Each kind lives under its own model name on the server: KV tensors under the model's
name, query tensors (exported by an engine with LMCache's query capture) under
``<model>##query``. A pure value type, like upstream's ``lmcache.sdk.cache_kind``.
"""

from __future__ import annotations

import enum

__all__ = ["QUERY_SUFFIX", "LMCacheSDKCacheKind"]

#: Suffix of the server-side model name of query tensors (upstream's convention).
QUERY_SUFFIX = "##query"


class LMCacheSDKCacheKind(enum.Enum):
    """A cacheable tensor family that LMCache exports (``KV`` or ``QUERY``)."""

    KV = "kv"
    QUERY = "query"

    def server_model_name(self, model_name: str) -> str:
        """The model name objects of this kind are stored under.

        Args:
            model_name: The model's own name.

        Returns:
            ``model_name`` for KV, ``f"{model_name}##query"`` for QUERY.
        """
        if self is LMCacheSDKCacheKind.QUERY:
            return f"{model_name}{QUERY_SUFFIX}"
        return model_name

    def base_model_name(self, model_name: str) -> str:
        """The model's own name, given the name objects of this kind are stored under.

        Args:
            model_name: A server-side model name.

        Returns:
            ``model_name`` without the ``##query`` suffix (QUERY), unchanged (KV).
        """
        if self is LMCacheSDKCacheKind.QUERY:
            return model_name.removesuffix(QUERY_SUFFIX)
        return model_name
