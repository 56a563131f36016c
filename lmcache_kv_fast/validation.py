"""Argument checks of the public API, run before anything is sent.

Every check raises a clear :class:`~lmcache_kv_fast.errors.KVCacheSDKError` subclass
(``InvalidArgumentError`` is also a ``ValueError``, ``InvalidTypeError`` a ``TypeError``)
naming what was expected and what came.
"""

from __future__ import annotations

import math
import operator
from typing import Annotated, Any

import msgspec
import torch

from lmcache_kv_fast.copy.tensor_checks import check_destination, check_source
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.constants import (
    FORBIDDEN_MODEL_CHARS,
    FORBIDDEN_SALT_CHARS,
    MAX_CACHE_SALT_LEN,
    MAX_TOKEN_ID,
)
from lmcache_kv_fast.transport.urls import parse_control_url, parse_http_url

#: Most copy threads the native core takes (csrc/thread_pool.cpp ``set_threads``).
MAX_COPY_THREADS = 1024

#: torch dtypes of token ids (quantized and bool dtypes are not integers here).
_TORCH_INT_DTYPES = frozenset({
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
})

#: A token list as the server accepts it (exact ints, no bools, in [0, 2**32)).
_TOKEN_LIST = list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]]


def _is_tensor_like(x: Any) -> bool:
    return hasattr(x, "tolist") and hasattr(x, "dtype") and hasattr(x, "ndim")


def normalize_tokens(tokens: Any, what: str = "tokens") -> list[int]:
    """Return ``tokens`` as a list of ints in ``[0, 2**32)``.

    Accepts a sequence of ints (Python or numpy integer scalars), a 1-D integer numpy
    array or torch tensor, or a ``range``.

    Raises:
        InvalidTypeError: Not a sequence of integers (bools, floats and strings refused).
        InvalidArgumentError: A token outside ``[0, 2**32)``.
    """
    if type(tokens) is list:  # the common case, checked in C (a Python loop is slow)
        try:
            return msgspec.convert(tokens, _TOKEN_LIST)
        except msgspec.ValidationError:
            pass  # numpy integers, or an error: the checks below say which
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise InvalidTypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__}")
    if _is_tensor_like(tokens):
        out = _tensor_tokens(tokens, what)
    elif isinstance(tokens, list) and all(type(t) is int for t in tokens):
        out = tokens
    else:
        try:
            seq = list(tokens)
        except TypeError:
            raise InvalidTypeError(
                f"{what} must be a sequence of ints, got {type(tokens).__name__}"
            ) from None
        out = [_token(t, what) for t in seq]
    if out and (min(out) < 0 or max(out) > MAX_TOKEN_ID):
        bad = next(t for t in out if t < 0 or t > MAX_TOKEN_ID)
        raise InvalidArgumentError(f"{what} must be in [0, 2**32), got {bad}")
    return out


def _tensor_tokens(tokens: Any, what: str) -> list[int]:
    """The ints of a 1-D integer array or tensor (numpy, torch or alike)."""
    if tokens.ndim != 1:
        raise InvalidArgumentError(f"{what} must be 1-D, got {tokens.ndim}-D")
    dtype = tokens.dtype
    if isinstance(tokens, torch.Tensor):
        ok = dtype in _TORCH_INT_DTYPES and not tokens.is_quantized
        if ok and tokens.device.type == "meta":
            raise InvalidTypeError(f"{what} is a tensor on the meta device (it has no data)")
    else:
        kind = getattr(dtype, "kind", None)  # numpy: "i" / "u" are the integers
        ok = kind in ("i", "u") if kind is not None else \
            "int" in str(dtype) and "bool" not in str(dtype)
    if not ok:
        raise InvalidTypeError(f"{what} must have an integer dtype, got {dtype}")
    try:
        out = tokens.tolist()
    except Exception as err:  # a tensor whose values cannot be read (sparse, ...)
        raise InvalidTypeError(
            f"{what}: cannot read the values of this {type(tokens).__name__} ({dtype}): {err}"
        ) from err
    if not isinstance(out, list) or not all(type(t) is int for t in out):
        raise InvalidTypeError(f"{what} must hold ints, got {type(tokens).__name__} of {dtype}")
    return out


def _token(t: Any, what: str) -> int:
    """One token of a generic sequence: an int or an integer scalar, never a bool."""
    dtype = getattr(t, "dtype", None)
    if isinstance(t, bool) or not hasattr(t, "__index__") or \
            (dtype is not None and "bool" in str(dtype)):  # numpy.bool_, torch bool scalars
        raise InvalidTypeError(f"{what} must contain only ints, got {type(t).__name__} {t!r:.40}")
    try:
        v = operator.index(t)
    except Exception as err:  # e.g. a float 0-d tensor
        raise InvalidTypeError(
            f"{what} must contain only ints, got {type(t).__name__} {t!r:.40}"
        ) from err
    if type(v) is not int:  # int subclasses (bool) out of __index__
        raise InvalidTypeError(f"{what} must contain only ints, got {type(t).__name__} {t!r:.40}")
    return v


def _check_text(value: Any, what: str) -> str:
    """A plain ``str`` that encodes to UTF-8 (no lone surrogates), as msgpack sends it."""
    if type(value) is not str:
        kind = f"a subclass of str ({type(value).__name__})" if isinstance(value, str) \
            else type(value).__name__
        raise InvalidTypeError(f"{what} must be a str, got {kind}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgumentError(
            f"{what} must be valid Unicode text, got {value!r:.80}: character "
            f"{value[err.start]!r} at {err.start} cannot be encoded (a lone surrogate)"
        ) from None
    return value


def check_salt(cache_salt: Any) -> str:
    """Validate ``cache_salt`` like the server does (docs/protocol.md §4.1), before anything is sent.

    Raises:
        InvalidTypeError: Not a str (a subclass of str is refused too).
        InvalidArgumentError: Longer than 128 characters, containing ``@ / \\`` or NUL, or
            not encodable (a lone surrogate).
    """
    _check_text(cache_salt, "cache_salt")
    if len(cache_salt) > MAX_CACHE_SALT_LEN:
        raise InvalidArgumentError(
            f"cache_salt must be at most {MAX_CACHE_SALT_LEN} characters, got {len(cache_salt)}"
        )
    bad = FORBIDDEN_SALT_CHARS.intersection(cache_salt)
    if bad:
        raise InvalidArgumentError(
            f"cache_salt must not contain {sorted(bad)!r} (forbidden: @ / \\ NUL)"
        )
    return cache_salt


def check_request_configs(request_configs: Any) -> dict[str, Any] | None:
    """Validate per-request ``request_configs`` (passed through in every key, docs/protocol.md §4.1).

    Raises:
        InvalidTypeError: Not None or a dict with str keys of msgpack-encodable values.
        InvalidArgumentError: Nested too deeply, or a str that cannot be encoded.
    """
    if request_configs is None:
        return None
    if not isinstance(request_configs, dict) or not all(
            isinstance(k, str) for k in request_configs):
        raise InvalidTypeError(
            "request_configs must be None or a dict with str keys, got "
            f"{type(request_configs).__name__}"
        )
    try:
        codec.encode(request_configs)
    except RecursionError:
        raise InvalidArgumentError(
            "request_configs is nested too deeply to be encoded"
        ) from None
    except UnicodeEncodeError as err:
        raise InvalidArgumentError(
            f"request_configs cannot be encoded: {err} (a lone surrogate in a str)"
        ) from err
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidTypeError(f"request_configs cannot be encoded: {err}") from err
    return request_configs


def check_connect_args(url: Any, http_url: Any, model_name: Any, timeout: Any,
                       world_size: Any, copy_threads: Any) -> None:
    """Validate the arguments of ``connect()`` before anything is contacted.

    Raises:
        InvalidArgumentError: A malformed URL (see ``transport/urls.py``), an empty,
            forbidden or unencodable model name, a non-positive timeout or world size, or
            a thread count outside ``[1, MAX_COPY_THREADS]``.
        InvalidTypeError: A model name that is not a plain str.
    """
    parse_control_url(url, "url")
    parse_http_url(http_url, "http_url")
    if isinstance(model_name, str) and not model_name:
        raise InvalidArgumentError("model_name must be a non-empty str, got ''")
    _check_text(model_name, "model_name")
    if FORBIDDEN_MODEL_CHARS.intersection(model_name):
        raise InvalidArgumentError(f"model_name must not contain '@', got {model_name!r:.80}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    if copy_threads is not None and (type(copy_threads) is not int or
                                     not 1 <= copy_threads <= MAX_COPY_THREADS):
        raise InvalidArgumentError(
            f"copy_threads must be an int in [1, {MAX_COPY_THREADS}] (or None), got "
            f"{copy_threads!r:.40}"
        )


def check_kv(kv: Any, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """Validate a KV tensor to store; return a contiguous CPU ``[P, L, T, D]`` view.

    Raises:
        InvalidTypeError: Not a tensor, or not of the model's ``dtype``.
        InvalidArgumentError: Not dense, a shape other than the model's, or on a device
            it cannot be copied from.
    """
    if not isinstance(kv, torch.Tensor):
        raise InvalidTypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.layout != torch.strided:
        raise InvalidArgumentError(f"kv must be a dense (strided) tensor, got {kv.layout}")
    lay = layout
    if kv.dtype != dtype:
        raise InvalidTypeError(
            f"kv has dtype {kv.dtype}, expected {dtype} (the model's KV dtype); "
            "convert it with kv.to(ctx.dtype)"
        )
    shape = tuple(kv.shape)
    if not _kv_shape_ok(shape, lay):
        raise InvalidArgumentError(
            f"kv has shape {list(shape)}, expected {_kv_shape_text(lay, 'T')}")
    if kv.requires_grad:
        kv = kv.detach()
    # storage bounds and neg/conj bits, before anything (.cpu(), .contiguous()) reads it
    kv = check_source(kv, "kv")
    if kv.device.type != "cpu":
        try:
            kv = kv.cpu()
        except RuntimeError as err:  # e.g. the meta device: no data
            raise InvalidArgumentError(
                f"kv is on device {kv.device} and cannot be copied to the CPU: {err}"
            ) from err
    if not kv.is_contiguous():
        kv = kv.contiguous()
    return kv if kv.dim() == 4 else kv.unsqueeze(0)


def check_out(out: Any, tokens: int, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """Validate a retrieve's ``out`` tensor: room for ``tokens`` tokens; returned as is.

    Raises:
        InvalidTypeError: Not a tensor, or not of the model's ``dtype``.
        InvalidArgumentError: Not dense, contiguous, on the CPU and without grad, or too
            small for the model's shape.
    """
    if not isinstance(out, torch.Tensor):
        raise InvalidTypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.layout != torch.strided:
        raise InvalidArgumentError(f"out must be a dense (strided) tensor, got {out.layout}")
    if out.requires_grad:
        raise InvalidArgumentError("out must not require grad (it is written in place)")
    lay = layout
    if out.dtype != dtype:
        raise InvalidTypeError(f"out has dtype {out.dtype}, expected {dtype}")
    if out.device.type != "cpu":
        raise InvalidArgumentError(f"out must be a CPU tensor, got device {out.device}")
    if not out.is_contiguous():
        raise InvalidArgumentError("out must be contiguous")
    check_destination(out, "out")
    shape = tuple(out.shape)
    if not _kv_shape_ok(shape, lay) or shape[-2] < tokens:
        raise InvalidArgumentError(
            f"out has shape {list(shape)}, expected {_kv_shape_text(lay, f'>={tokens}')} "
            "(room for every requested whole-chunk token)"
        )
    return out


def _kv_shape_ok(shape: tuple[int, ...], lay: KVLayout) -> bool:
    """Whether ``shape`` is a KV tensor's of ``lay``, any token count.

    ``[2, L, T, D]`` with two planes; ``[L, T, D]`` or ``[1, L, T, D]`` with one (MLA).
    """
    L, D = lay.num_layers, lay.hidden_size
    if lay.planes == 2:
        return len(shape) == 4 and shape[0] == 2 and shape[1] == L and shape[3] == D
    return (len(shape) == 3 and shape[0] == L and shape[2] == D) or \
        (len(shape) == 4 and shape[0] == 1 and shape[1] == L and shape[3] == D)


def _kv_shape_text(lay: KVLayout, tokens: str) -> str:
    """The shapes :func:`_kv_shape_ok` accepts, ``tokens`` standing for the token count."""
    L, D = lay.num_layers, lay.hidden_size
    if lay.planes == 2:
        return f"[2, {L}, {tokens}, {D}]"
    return f"[{L}, {tokens}, {D}] or [1, {L}, {tokens}, {D}]"
