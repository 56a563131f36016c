"""Argument checks of the public API, run before anything is sent.

Every check raises a clear :class:`~lmcache_kv_fast.errors.KVCacheSDKError` subclass
(``InvalidArgumentError`` is also a ``ValueError``, ``InvalidTypeError`` a ``TypeError``)
naming what was expected and what came.
"""

from __future__ import annotations

import math
import operator
import re
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

_ZMQ_URL = re.compile(r"^tcp://[^\s/:]+:\d{1,5}$")
#: ``ipc://<path>``: a ZMQ IPC endpoint (a Unix socket path, e.g. a proxy's), as upstream's
#: request-client factory accepts it. The sdk package (``lmcache_kv_fast.sdk``) needs it.
_ZMQ_IPC_URL = re.compile(r"^ipc://[^\s\x00]+$")
_HTTP_URL = re.compile(r"^https?://[^\s/]+(:\d{1,5})?/?$")

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
    if type(tokens) is list:  # the common case, checked in C (~10x faster than a loop)
        try:
            return msgspec.convert(tokens, _TOKEN_LIST)
        except msgspec.ValidationError:
            pass  # numpy integers, or an error: the checks below say which
    if isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise InvalidTypeError(f"{what} must be a sequence of ints, got {type(tokens).__name__}")
    if _is_tensor_like(tokens):
        if tokens.ndim != 1:
            raise InvalidArgumentError(f"{what} must be 1-D, got {tokens.ndim}-D")
        kind = str(tokens.dtype)
        if "int" not in kind or "bool" in kind:
            raise InvalidTypeError(f"{what} must have an integer dtype, got {kind}")
        out = tokens.tolist()
    elif isinstance(tokens, list) and all(type(t) is int for t in tokens):
        out = tokens
    else:
        try:
            seq = list(tokens)
        except TypeError:
            raise InvalidTypeError(
                f"{what} must be a sequence of ints, got {type(tokens).__name__}"
            ) from None
        out = []
        for t in seq:
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise InvalidTypeError(
                    f"{what} must contain only ints, got {type(t).__name__} {t!r:.40}"
                )
            out.append(operator.index(t))
    if out and (min(out) < 0 or max(out) > MAX_TOKEN_ID):
        bad = next(t for t in out if t < 0 or t > MAX_TOKEN_ID)
        raise InvalidArgumentError(f"{what} must be in [0, 2**32), got {bad}")
    return out


def check_salt(cache_salt: Any) -> str:
    """Validate ``cache_salt`` like the server does (doc §4.1), before anything is sent.

    Raises:
        InvalidTypeError: Not a str.
        InvalidArgumentError: Longer than 128 characters or containing ``@ / \\`` or NUL.
    """
    if not isinstance(cache_salt, str):
        raise InvalidTypeError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
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
    """Validate per-request ``request_configs`` (passed through in every key, doc §4.1).

    Raises:
        InvalidTypeError: Not None or a dict with str keys of msgpack-encodable values.
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
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidTypeError(f"request_configs cannot be encoded: {err}") from err
    return request_configs


def check_connect_args(url: Any, http_url: Any, model_name: Any, timeout: Any,
                       world_size: Any, copy_threads: Any) -> None:
    """Validate the arguments of ``connect()`` before anything is contacted.

    Raises:
        InvalidArgumentError: A malformed URL, an empty or forbidden model name, or a
            non-positive timeout, world size or thread count.
    """
    if isinstance(url, str) and _ZMQ_IPC_URL.match(url):
        pass
    elif not isinstance(url, str) or not _ZMQ_URL.match(url) or \
            not 0 < int(url.rsplit(":", 1)[1]) < 65536:
        raise InvalidArgumentError(
            f"url must look like 'tcp://host:port' (port 1..65535) or 'ipc://path', "
            f"got {url!r:.80}"
        )
    if not isinstance(http_url, str) or not _HTTP_URL.match(http_url) or (
        (m := re.search(r":(\d+)/?$", http_url)) is not None and not 0 < int(m[1]) < 65536
    ):
        raise InvalidArgumentError(
            f"http_url must look like 'http://host:port' (port 1..65535), got {http_url!r:.80}"
        )
    if not isinstance(model_name, str) or not model_name:
        raise InvalidArgumentError(f"model_name must be a non-empty str, got {model_name!r:.80}")
    if FORBIDDEN_MODEL_CHARS.intersection(model_name):
        raise InvalidArgumentError(f"model_name must not contain '@', got {model_name!r:.80}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    if copy_threads is not None and (type(copy_threads) is not int or copy_threads < 1):
        raise InvalidArgumentError(f"copy_threads must be a positive int, got {copy_threads!r}")


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
    if lay.planes == 2:
        ok = len(shape) == 4 and shape[0] == 2 and shape[1] == lay.num_layers and \
            shape[3] == lay.hidden_size
        want = f"[2, {lay.num_layers}, T, {lay.hidden_size}]"
    else:
        ok = (len(shape) == 3 and shape[0] == lay.num_layers and shape[2] == lay.hidden_size) \
            or (len(shape) == 4 and shape[0] == 1 and shape[1] == lay.num_layers
                and shape[3] == lay.hidden_size)
        want = f"[{lay.num_layers}, T, {lay.hidden_size}] or [1, {lay.num_layers}, T, " \
               f"{lay.hidden_size}]"
    if not ok:
        raise InvalidArgumentError(f"kv has shape {list(shape)}, expected {want}")
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
    if lay.planes == 2:
        ok = len(shape) == 4 and shape[0] == 2 and shape[1] == lay.num_layers and \
            shape[3] == lay.hidden_size
        want = f"[2, {lay.num_layers}, >={tokens}, {lay.hidden_size}]"
    else:
        ok = (len(shape) == 3 and shape[0] == lay.num_layers and shape[2] == lay.hidden_size) \
            or (len(shape) == 4 and shape[0] == 1 and shape[1] == lay.num_layers
                and shape[3] == lay.hidden_size)
        want = f"[{lay.num_layers}, >={tokens}, {lay.hidden_size}]"
    if not ok or shape[-2] < tokens:
        raise InvalidArgumentError(
            f"out has shape {list(shape)}, expected {want} (room for every requested "
            "whole-chunk token)"
        )
    return out
