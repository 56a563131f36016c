"""API keys of a key-protected LMCache server (0.5.7+, docs/deployment.md).

The server reads its keys from ``--api-key-file``, ``LMCACHE_API_KEY_FILE`` or
``LMCACHE_API_KEY``; a client without ``api_key=`` reads the same two environment
variables. The key is kept in an :class:`ApiKey` whose ``repr`` and ``str`` hide it, so it
reaches no log line, error message or traceback's locals by accident.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["ENV_KEY", "ENV_KEY_FILE", "ApiKey", "resolve_api_key"]

#: The server's own variable names (and, second, their legacy ``HTTP`` forms).
ENV_KEY = ("LMCACHE_API_KEY", "LMCACHE_HTTP_API_KEY")
ENV_KEY_FILE = ("LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY_FILE")
#: How to pass a key, for error messages.
HOW_TO_PASS = ("pass connect(..., api_key=...) or set LMCACHE_API_KEY (or "
               "LMCACHE_API_KEY_FILE, a file holding the key on one line)")


class ApiKey:
    """A secret sent as ``Authorization: Bearer <key>``; never shown."""

    __slots__ = ("_secret", "source")

    def __init__(self, secret: str, source: str) -> None:
        if not secret or any(c in secret for c in "\r\n\x00") or not secret.isascii() \
                or secret != secret.strip():
            raise InvalidArgumentError(
                f"API key from {source}: expected one non-empty line of printable ASCII "
                "without surrounding blanks (the key itself is not shown)"
            )
        self._secret = secret
        #: Where the key came from (``"api_key="``, an environment variable, a file path).
        self.source = source

    def header(self) -> str:
        """The ``Authorization`` header's value."""
        return f"Bearer {self._secret}"

    def __repr__(self) -> str:
        return f"ApiKey(<hidden>, source={self.source!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKey) and other._secret == self._secret

    def __hash__(self) -> int:
        return hash(self._secret)


def resolve_api_key(api_key: str | ApiKey | None) -> ApiKey | None:
    """The key to send: ``api_key`` when given, else the environment's, else None.

    The environment is read in this order: ``LMCACHE_API_KEY``, ``LMCACHE_API_KEY_FILE``,
    then their legacy forms ``LMCACHE_HTTP_API_KEY``, ``LMCACHE_HTTP_API_KEY_FILE``.

    Raises:
        InvalidTypeError: ``api_key`` is not a str.
        InvalidArgumentError: The key is empty or not one line, or its file cannot be read.
    """
    if isinstance(api_key, ApiKey):
        return api_key
    if api_key is not None:
        if not isinstance(api_key, str):
            raise InvalidTypeError(f"api_key must be a str, got {type(api_key).__name__}")
        return ApiKey(api_key, "api_key=")
    for key_var, file_var in zip(ENV_KEY, ENV_KEY_FILE, strict=True):
        value = os.environ.get(key_var)
        if value:
            return ApiKey(value.strip(), key_var)
        path = os.environ.get(file_var)
        if path:
            return ApiKey(_read_key_file(path, file_var), f"{file_var}={path}")
    return None


def _read_key_file(path: str, var: str) -> str:
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(
            f"{var}={path!r}: cannot read the API key file ({type(err).__name__}: "
            f"{getattr(err, 'strerror', None) or 'not ASCII'})"
        ) from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) != 1:
        raise InvalidArgumentError(
            f"{var}={path!r}: expected exactly one non-empty line (the key), found "
            f"{len(lines)}"
        )
    return lines[0]
