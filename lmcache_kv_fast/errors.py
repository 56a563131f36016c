"""Exception types of lmcache-kv-fast.

``LMCacheSDKError`` is the root of every error this project raises; it keeps the name of
upstream 0.5.6 (``lmcache.sdk.context.LMCacheSDKError``), so a 0.5.6 program that catches
it catches ours. ``KVCacheSDKError`` keeps the name of the older upstream SDK
(``lmcache.sdk.kvcache.KVCacheSDKError``, 0.5.1/0.5.2) and is the base of the KV-cache
errors below. ``InvalidArgumentError`` is both a ``KVCacheSDKError`` and a
``ValueError`` so callers can use either convention.
"""

from __future__ import annotations


class LMCacheSDKError(RuntimeError):
    """Root of every lmcache-kv-fast error (the 0.5.6 upstream name)."""


class KVCacheSDKError(LMCacheSDKError):
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


class ServerUnavailableError(KVCacheSDKError, ConnectionError):
    """The server is gone (killed, frozen, unreachable, or it forgot this client).

    A batch raises it when an item failed (e.g. timed out) and the server then did not
    answer one liveness ping: the whole batch stops at once instead of paying the timeout
    per item. ``report`` is the batch's report at that point (items done, failed, and not
    attempted), or None.
    """

    report: object | None = None


class ProtocolError(KVCacheSDKError):
    """The server sent something this SDK refuses to act on (malformed or hostile reply)."""


class ContextClosedError(KVCacheSDKError):
    """The context was used after ``close()``."""


class MissingExtraError(KVCacheSDKError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class ServerError(ProtocolError):
    """The server answered a request with an error (gRPC transport only).

    Over ZMQ a failed request gets no reply at all (``ServerTimeoutError``); over gRPC the
    server's exception comes back as a status (``UNKNOWN`` with its message,
    ``UNIMPLEMENTED`` for a disabled operation, ...). ``code`` is the status name.
    """

    code: str = ""


class ConnectionLostError(ServerTimeoutError, ServerUnavailableError):
    """The connection to the server dropped while a request was in flight (gRPC).

    Both a ``ServerTimeoutError`` (the request got no reply: the flows settle it like one
    that timed out, and a restarted server turns it into "reconnect") and a
    ``ServerUnavailableError``.
    """


class AuthenticationError(KVCacheSDKError, PermissionError):
    """The server refused this client's API key, or wants one and none was given.

    The message says how to pass a key (``api_key=``, ``LMCACHE_API_KEY``,
    ``LMCACHE_API_KEY_FILE``); it never contains the key.
    """


class UnsupportedServerError(KVCacheSDKError):
    """The server speaks a wire dialect this SDK does not know (a newer release).

    The message names the server's version and the versions this SDK speaks.
    """
