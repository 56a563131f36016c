"""The request URLs the 0.5.6 SDK accepts, mapped onto what this SDK connects to.

Upstream's request-client factory (``lmcache.v1.multiprocess.transport.factory``) takes
``tcp://``, ``ipc://``, ``inproc://`` (ZMQ), ``grpc://``, ``grpc+unix://`` (gRPC) and a
bare ``host:port``, which means ``tcp://host:port``; the scheme is case-insensitive. This
SDK speaks ZMQ or gRPC to a server in another process:

* ``host:port`` becomes ``tcp://host:port``; ``TCP://`` becomes ``tcp://``;
* ``ipc://path`` is kept (the 0.5.6 server itself binds TCP only, so an IPC path reaches
  it through a forwarder);
* ``grpc://host:port`` and ``grpc+unix:///path`` (a server started with
  ``--transport grpc``) are kept, scheme lower-cased (docs/protocol.md §12);
* ``inproc://`` (an endpoint inside the calling process) is refused with an error saying
  why.

Everything else (port ranges, hosts, whitespace) is checked by the core's URL validation
when the context connects.
"""

from __future__ import annotations

from typing import Any

from lmcache_kv_fast.errors import InvalidArgumentError

__all__ = ["normalize_request_url"]

_REFUSED = {
    "inproc": "an inproc:// endpoint lives inside one process; the LMCache server runs in "
              "another (use its tcp://host:port)",
}
_KEPT = ("tcp", "ipc", "grpc", "grpc+unix")


def normalize_request_url(url: Any) -> str:
    """The control-plane URL to connect to for a 0.5.6-style ``url`` argument.

    Args:
        url: ``tcp://host:port``, ``host:port``, ``ipc://path``, ``grpc://host:port`` or
            ``grpc+unix:///path``.

    Returns:
        The URL with its scheme lower-cased (``tcp://`` added to a bare ``host:port``);
        other forms are passed on unchanged for the core's validation to refuse with its
        message.

    Raises:
        InvalidArgumentError: ``inproc://``, or not a string.
    """
    if not isinstance(url, str):
        raise InvalidArgumentError(
            f"url must be a str like 'tcp://host:port', got {type(url).__name__} {url!r:.80}"
        )
    scheme, sep, rest = url.partition("://")
    if not sep:
        # upstream: "no scheme" means TCP ("host:port")
        return f"tcp://{url}" if url and ":" in url else url
    low = scheme.lower()
    if low in _REFUSED:
        raise InvalidArgumentError(f"url {url!r:.80}: {_REFUSED[low]}")
    if low in _KEPT:
        return f"{low}://{rest}"
    return url
