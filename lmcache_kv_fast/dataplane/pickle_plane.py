"""Pickle data plane (docs/protocol.md §7.4, §7.5).

The server pickles a list of CPU chunk tensors into ``prepare_retrieve``'s ``data`` and
unpickles our list on ``commit_store``. Unpickling peer data with ``pickle.loads`` would let
a hostile server run code in the client (docs/protocol.md §11 #4), so replies are read with a
restricted unpickler: only the three globals a tensor pickle needs are resolved, storages
are loaded with ``torch.load(weights_only=True)``, and the result must be a list of CPU
tensors of exactly the expected count, shape and dtype.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_kv_fast.errors import ProtocolError

#: Pickle protocol of the stream we send (what the server's own client produces).
PICKLE_PROTOCOL = 4


def _load_storage(b: bytes) -> Any:
    if not isinstance(b, (bytes, bytearray)):
        raise pickle.UnpicklingError("storage payload is not bytes")
    return torch.load(io.BytesIO(b), weights_only=True)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                    requires_grad: Any = False, backward_hooks: Any = None,
                    metadata: Any = None) -> torch.Tensor:
    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise pickle.UnpicklingError(f"tensor storage of type {type(storage).__name__}")
    if not (isinstance(size, tuple) and isinstance(stride, tuple)
            and all(type(x) is int for x in (*size, *stride, storage_offset))):
        raise pickle.UnpicklingError("tensor size/stride/offset must be integers")
    if backward_hooks:
        raise pickle.UnpicklingError("tensor with backward hooks")
    # torch's rebuild *resizes* a too-small storage (huge allocations, uninitialised
    # bytes): the view must lie inside the storage the peer actually sent.
    if not isinstance(storage, torch.TypedStorage) or len(size) != len(stride) or \
            storage_offset < 0 or any(x < 0 for x in (*size, *stride)):
        raise pickle.UnpicklingError("tensor storage/size/stride/offset out of range")
    if all(size) and storage_offset + sum((n - 1) * s for n, s in zip(size, stride,
                                                                     strict=True)) >= \
            storage._size():
        raise pickle.UnpicklingError(
            f"tensor view {size}/{stride}+{storage_offset} exceeds its storage of "
            f"{storage._size()} elements"
        )
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, False,
                                           collections.OrderedDict())


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals of a plain CPU tensor pickle; everything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        """Return the allowed callable for ``module.name`` or refuse."""
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name} in server pickle data"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids (not used by tensor pickles)."""
        raise pickle.UnpicklingError("refused persistent id in server pickle data")


def safe_loads_chunks(data: bytes | memoryview, count: int, numel: int,
                      dtype: torch.dtype, what: str,
                      shape: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Unpickle a server chunk list safely and check it.

    Args:
        data: The pickle bytes from the server.
        count: Expected number of chunk tensors.
        numel: Expected elements per chunk (shape ``[P, L, C, W]`` or ``[1, L, C, W]``).
        dtype: Expected dtype.
        what: Operation name for messages.
        shape: Expected chunk shape ``[P, L, C, W]``; when given, a tensor must have
            exactly it (or, for ``P == 1``, ``[L, C, W]``): same-size tensors of another
            geometry are refused, never reinterpreted.

    Returns:
        The chunk tensors, each contiguous on the CPU.

    Raises:
        ProtocolError: Anything but a list of ``count`` CPU tensors of that size and dtype.
    """
    try:
        obj = RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as err:
        raise ProtocolError(f"{what}: refused server pickle data: {err}") from err
    if not isinstance(obj, list) or len(obj) != count:
        got = f"list of {len(obj)}" if isinstance(obj, list) else type(obj).__name__
        raise ProtocolError(f"{what}: expected a list of {count} chunk tensors, got {got}")
    for k, t in enumerate(obj):
        if not isinstance(t, torch.Tensor):
            raise ProtocolError(f"{what}: chunk {k} is a {type(t).__name__}, not a tensor")
        if t.device.type != "cpu" or t.dtype != dtype or t.numel() != numel or (
            shape is not None and not _shape_ok(tuple(t.shape), tuple(shape))
        ):
            raise ProtocolError(
                f"{what}: chunk {k} is {t.dtype} {tuple(t.shape)} on {t.device}, expected "
                f"{dtype} {list(shape) if shape is not None else ''} with {numel} elements on cpu"
            )
        if not t.is_contiguous():
            obj[k] = t.contiguous()
    return obj


def _shape_ok(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return got == want or (want[:1] == (1,) and got == want[1:])


def dumps_chunks(chunks: Sequence[torch.Tensor]) -> bytes:
    """Pickle a list of CPU chunk tensors the way the server expects."""
    return pickle.dumps(list(chunks), protocol=PICKLE_PROTOCOL)
