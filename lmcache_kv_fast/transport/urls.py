"""Strict parsing of the server addresses given to ``connect()`` (ZMQ, gRPC and HTTP URLs).

A URL is refused at once, with a message that shows what came (``repr``) and why, when
ZMQ or ``http.client`` would reject it later or read it differently: whitespace or control
characters anywhere (a trailing newline read from a config file), a non-ASCII or wildcard
host (``tcp://*:5555`` is a bind address), a missing or out-of-range port, a path.

Grammar (``ZMQ_SCHEMES`` / ``HTTP_SCHEMES`` list the schemes; a new form such as
``ipc://path`` or a bare ``host:port`` is one more branch in :func:`parse_zmq_url`)::

    tcp-url  = "tcp://" host ":" port
    grpc-url = "grpc://" host ":" port | "grpc+unix://" absolute-path
    http-url = ("http" | "https") "://" host [":" port] ["/"]
    host     = dns-name | ipv4 | "[" ipv6 "]"
    port     = 1..65535 (ASCII digits)
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from lmcache_kv_fast.errors import InvalidArgumentError

#: Schemes of the ZMQ control plane this SDK connects to. ``ipc://path`` (a Unix socket,
#: e.g. a forwarder in front of the server, which itself binds TCP) is accepted as
#: upstream's request client accepts it (the sdk package, ``lmcache_kv_fast.sdk``).
ZMQ_SCHEMES = ("tcp", "ipc")
#: Longest ``ipc://`` path (a Unix socket's ``sun_path`` holds 108 bytes with the NUL).
MAX_IPC_PATH = 107
#: Schemes of the gRPC control plane (``lmcache server --transport grpc``): ``grpc://host:port``
#: is the gRPC target ``host:port``, ``grpc+unix:///path`` the target ``unix:///path``.
GRPC_SCHEMES = ("grpc", "grpc+unix")
#: Schemes of the HTTP info plane and their default ports.
HTTP_SCHEMES = {"http": 80, "https": 443}

_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class Endpoint:
    """A parsed server address.

    Attributes:
        scheme: ``tcp``, ``ipc``, ``grpc``, ``grpc+unix``, ``http`` or ``https``.
        host: Host name or IP address (an IPv6 address without its brackets).
        port: TCP port, 1..65535.
        ipv6: The host is an IPv6 literal (a ZMQ socket needs ``IPV6`` set to reach it).
    """

    scheme: str
    host: str
    port: int
    ipv6: bool = False

    @property
    def netloc(self) -> str:
        """``host:port`` (``[v6]:port`` for an IPv6 literal; the path for ``ipc``)."""
        if self.scheme in ("ipc", "grpc+unix"):
            return self.host
        host = f"[{self.host}]" if self.ipv6 else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        """The canonical URL, e.g. ``tcp://127.0.0.1:5555``."""
        return f"{self.scheme}://{self.netloc}"

    @property
    def transport(self) -> str:
        """The control-plane transport of this address: ``"grpc"`` or ``"zmq"``."""
        return "grpc" if self.scheme in GRPC_SCHEMES else "zmq"

    @property
    def grpc_target(self) -> str:
        """The target ``grpc.insecure_channel`` takes: ``host:port`` or ``unix:///path``."""
        if self.scheme == "grpc+unix":
            return f"unix://{self.host}"
        return self.netloc


def parse_zmq_url(url: Any, what: str = "url") -> Endpoint:
    """Parse a ZMQ URL of the server's control plane (``tcp://host:port`` or ``ipc://path``).

    For ``ipc`` the returned endpoint's ``host`` is the socket path and ``port`` is 0.

    Raises:
        InvalidArgumentError: Anything else; the message starts with
            ``"<what> must look like"`` and says what is wrong.
    """
    expect = f"{what} must look like 'tcp://host:port' (port 1..65535) or 'ipc://path'"
    scheme, rest = _scheme_and_rest(url, expect, ZMQ_SCHEMES,
                                    f"the scheme must be {' or '.join(ZMQ_SCHEMES)}://")
    if scheme == "ipc":
        if not rest or rest == "*":
            raise _bad(expect, url, "the ipc:// path is empty")
        if len(rest.encode()) > MAX_IPC_PATH:
            raise _bad(expect, url, f"the ipc:// path is longer than {MAX_IPC_PATH} bytes")
        return Endpoint(scheme, rest, 0)
    return _host_endpoint(scheme, rest, expect, url, default_port=None)


def parse_grpc_url(url: Any, what: str = "url") -> Endpoint:
    """Parse a gRPC URL of the control plane (``grpc://host:port``, ``grpc+unix:///path``).

    For ``grpc+unix`` the returned endpoint's ``host`` is the socket path and ``port`` 0.

    Raises:
        InvalidArgumentError: Anything else; the message starts with
            ``"<what> must look like"`` and says what is wrong.
    """
    expect = (f"{what} must look like 'grpc://host:port' (port 1..65535) or "
              "'grpc+unix:///absolute/path'")
    scheme, rest = _scheme_and_rest(url, expect, GRPC_SCHEMES,
                                    f"the scheme must be {' or '.join(GRPC_SCHEMES)}://")
    if scheme == "grpc+unix":
        return Endpoint(scheme, _socket_path(rest, expect, url, "grpc+unix"), 0)
    return _host_endpoint(scheme, rest, expect, url, default_port=None)


def parse_control_url(url: Any, what: str = "url") -> Endpoint:
    """Parse the control-plane URL of ``connect()``: ZMQ (``tcp``, ``ipc``) or gRPC.

    Raises:
        InvalidArgumentError: Neither; the message starts with ``"<what> must look like"``.
    """
    text = url.partition("://")[0] if isinstance(url, str) else ""
    if text in GRPC_SCHEMES:
        return parse_grpc_url(url, what)
    if text in ZMQ_SCHEMES or not isinstance(url, str):
        return parse_zmq_url(url, what)
    expect = (f"{what} must look like 'tcp://host:port', 'ipc://path', 'grpc://host:port' "
              "or 'grpc+unix:///path'")
    _text(url, expect)  # whitespace, control characters ... first, as for the other forms
    raise _bad(expect, url, "the scheme must be one of "
               f"{', '.join(s + '://' for s in (*ZMQ_SCHEMES, *GRPC_SCHEMES))}")


def _socket_path(rest: str, expect: str, url: str, scheme: str) -> str:
    """The absolute Unix socket path of ``grpc+unix://<rest>``."""
    if not rest.startswith("/") or rest == "/":
        raise _bad(expect, url, f"the {scheme}:// path must be absolute "
                   f"({scheme}:///run/lmcache.sock)")
    if "?" in rest or "#" in rest:
        raise _bad(expect, url, "no query or fragment is allowed")
    if len(rest.encode()) > MAX_IPC_PATH:
        raise _bad(expect, url, f"the {scheme}:// path is longer than {MAX_IPC_PATH} bytes")
    return rest


def parse_http_url(url: Any, what: str = "http_url") -> Endpoint:
    """Parse the HTTP URL of the server's info plane (``http://host[:port][/]``).

    Raises:
        InvalidArgumentError: Anything else; the message starts with
            ``"<what> must look like"`` and says what is wrong.
    """
    expect = f"{what} must look like 'http://host:port' (port 1..65535)"
    scheme, rest = _scheme_and_rest(url, expect, tuple(HTTP_SCHEMES),
                                    "the scheme must be http:// or https://")
    return _host_endpoint(scheme, rest.removesuffix("/"), expect, url,
                          default_port=HTTP_SCHEMES[scheme])


def _scheme_and_rest(url: Any, expect: str, schemes: tuple[str, ...],
                     bad_scheme: str) -> tuple[str, str]:
    """``(scheme, rest)`` of ``scheme://rest`` after the character checks of :func:`_text`."""
    scheme, sep, rest = _text(url, expect).partition("://")
    if not sep or scheme not in schemes:
        raise _bad(expect, url, bad_scheme)
    return scheme, rest


def _host_endpoint(scheme: str, rest: str, expect: str, url: str,
                   default_port: int | None) -> Endpoint:
    """The endpoint of ``host[:port]`` (``rest``): no path, query or fragment."""
    if "/" in rest or "?" in rest or "#" in rest:
        raise _bad(expect, url, "no path, query or fragment is allowed")
    (host, v6), port = _host_port(rest, expect, url, default_port=default_port)
    return Endpoint(scheme, host, port, v6)


def _text(url: Any, expect: str) -> str:
    if not isinstance(url, str):
        raise InvalidArgumentError(f"{expect}, got {type(url).__name__} {url!r:.80}")
    text = str(url)  # a str subclass: its plain value
    if text.endswith(("\n", "\r")):
        raise _bad(expect, url, "it ends with a newline")
    if any(c.isspace() for c in text):
        raise _bad(expect, url, "it contains whitespace")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise _bad(expect, url, "it contains a control character")
    if not text.isascii():
        raise _bad(expect, url, "it must be ASCII (write a non-ASCII host name in its "
                               "punycode 'xn--' form)")
    return text


def _host_port(rest: str, expect: str, url: str,
               default_port: int | None) -> tuple[tuple[str, bool], int]:
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise _bad(expect, url, "an IPv6 host needs its closing ']'")
        host, tail = rest[1:end], rest[end + 1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(expect, url, f"{host!r} is not an IPv6 address") from None
        v6 = True
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            host, port_text = rest, ""
        tail = f":{port_text}" if colon else ""
        v6 = False
        _check_host(host, expect, url)
    if tail:
        if not tail.startswith(":"):
            raise _bad(expect, url, "the host must be followed by ':port'")
        port_text = tail[1:]
        if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
            raise _bad(expect, url, f"port {port_text!r} is not in 1..65535")
        port = int(port_text)
    elif default_port is None:
        raise _bad(expect, url, "the port is missing")
    else:
        port = default_port
    return (host, v6), port


def _check_host(host: str, expect: str, url: str) -> None:
    if not host:
        raise _bad(expect, url, "the host is missing")
    if "*" in host:
        raise _bad(expect, url, "a wildcard host is a bind address: give the server's host")
    if ":" in host:
        raise _bad(expect, url, "an IPv6 host must be in brackets, e.g. tcp://[::1]:5555")
    if all(c.isdigit() or c == "." for c in host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _bad(expect, url, f"{host!r} is not an IPv4 address") from None
        return
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise _bad(expect, url, f"{host!r} is not a valid host name")


def _bad(expect: str, url: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{expect}, got {url!r:.80}: {why}")
