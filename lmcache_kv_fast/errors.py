"""Exception types of lmcache-kv-fast.

``KVCacheSDKError`` keeps the upstream name (``lmcache.sdk.KVCacheSDKError``) so code
written against the upstream SDK catches the same class. ``InvalidArgumentError`` is
both a ``KVCacheSDKError`` and a ``ValueError`` so callers can use either convention.
"""

from __future__ import annotations


class KVCacheSDKError(RuntimeError):
    """Raised when an SDK KV-cache operation fails."""


class InvalidArgumentError(KVCacheSDKError, ValueError):
    """An argument has the wrong value: the message names it, what was expected and what came."""


class InvalidTypeError(KVCacheSDKError, TypeError):
    """An argument has the wrong type: the message names it, what was expected and what came."""


class ServerTimeoutError(KVCacheSDKError, TimeoutError):
    """The server did not answer in time.

    It never sends error replies, so this is how rejected requests, dead servers and disabled
    operations all look.
    """


class ProtocolError(KVCacheSDKError):
    """The server sent something this SDK refuses to act on (malformed or hostile reply)."""


class ContextClosedError(KVCacheSDKError):
    """The context was used after ``close()``."""


class MissingExtraError(KVCacheSDKError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""
