"""Frame encoding/decoding of the ZMQ control plane (docs/protocol.md §2.2, §2.5)."""

from __future__ import annotations

from typing import Any

import msgspec

from lmcache_kv_fast.errors import ProtocolError

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(value: Any) -> bytes:
    """Encode one payload frame (msgpack; Structs become maps keyed by field name)."""
    return _ENCODER.encode(value)


def decoder_for(tp: Any) -> msgspec.msgpack.Decoder:
    """Return a cached strict decoder for ``tp``."""
    dec = _DECODERS.get(tp)
    if dec is None:
        dec = msgspec.msgpack.Decoder(tp)
        _DECODERS[tp] = dec
    return dec


def decode(frame: bytes, tp: Any, *, what: str) -> Any:
    """Decode a reply frame as ``tp``.

    Raises:
        ProtocolError: If the frame is not a valid msgpack document of that type (one
            nested deeper than Python's recursion limit included).
    """
    try:
        return decoder_for(tp).decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError(f"malformed reply to {what}: expected {tp!r}: {err}") from err
    except RecursionError:
        raise ProtocolError(
            f"malformed reply to {what}: msgpack nested too deeply to decode"
        ) from None
