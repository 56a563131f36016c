"""Boundary checks of the tensors whose bytes the copy layer reads or writes.

Both copy backends call these on every scatter / gather (a few attribute reads per call,
not per chunk); argument validation may call them earlier, before anything is sent to
the server, so a refused tensor leaves nothing reserved there:

* :func:`check_storage`: the memory the tensor's shape and strides address lies inside
  its storage (a storage shrunk with ``t.untyped_storage().resize_(n)`` or freed with
  ``resize_(0)`` would be read or written out of bounds: SIGSEGV or silent corruption).
* :func:`check_source`: :func:`check_storage`, then the negative and conjugate bits are
  resolved (the raw bytes of ``torch._neg_view(kv)`` are the negated values; a copy of
  the raw bytes would store ``-kv``). Call it before any torch op reads the tensor
  (``.contiguous()``, ``.cpu()``): those read out of bounds on a shrunk storage too.
* :func:`check_destination`: :func:`check_storage`, and the negative / conjugate bits are
  refused: the copy writes raw bytes, which such a view would read back negated /
  conjugated. Resolving them in place would need a second full pass over the
  destination (``neg_()`` after the copy) for views only private or exotic APIs make.

All raise :class:`~lmcache_kv_fast.errors.InvalidArgumentError` naming the tensor.
"""

from __future__ import annotations

import torch

from lmcache_kv_fast.errors import InvalidArgumentError

__all__ = ["check_destination", "check_source", "check_storage", "extent_bytes"]


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (0 for an empty tensor).

    ``(1 + sum((size_i - 1) * stride_i)) * itemsize`` (torch strides are never negative);
    ``numel * itemsize`` for a contiguous tensor.
    """
    n = t.numel()
    if n == 0:
        return 0
    if t.is_contiguous():
        return n * t.element_size()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def check_storage(t: torch.Tensor, what: str) -> int:
    """Check the memory ``t`` addresses lies inside its storage; return the bytes that back it.

    Returns:
        Bytes of ``t``'s storage from ``t.data_ptr()`` to the end of the storage (at least
        :func:`extent_bytes`).

    Raises:
        InvalidArgumentError: ``t`` has no storage (meta device, sparse), its storage was
            freed (null data pointer) or holds fewer bytes than its shape, strides and
            storage offset address.
    """
    if t.is_meta:
        raise InvalidArgumentError(f"{what} is on device meta: it has no data to copy")
    try:
        storage = t.untyped_storage()
        need = extent_bytes(t)
    except (RuntimeError, NotImplementedError) as err:
        raise InvalidArgumentError(
            f"{what} has no accessible storage (layout {t.layout}): {err}") from err
    isz = t.element_size()
    offset = t.storage_offset() * isz
    have = storage.nbytes() - offset
    if need == 0:
        return max(have, 0)
    if storage.data_ptr() == 0:
        raise InvalidArgumentError(
            f"{what} has shape {list(t.shape)} ({need} bytes) but its storage was freed "
            "(null data pointer, e.g. after untyped_storage().resize_(0)); expected a "
            "tensor whose storage holds its elements"
        )
    if need > have:
        raise InvalidArgumentError(
            f"{what} has shape {list(t.shape)}, strides {list(t.stride())} and storage "
            f"offset {t.storage_offset()}, addressing {need} bytes from byte {offset} of its "
            f"storage, but the storage holds only {storage.nbytes()} bytes (was it shrunk "
            "with untyped_storage().resize_()?); expected a tensor whose storage holds "
            "its elements"
        )
    return have


def check_source(t: torch.Tensor, what: str) -> torch.Tensor:
    """Check a tensor whose bytes will be read; return it with neg/conj bits resolved.

    Returns ``t`` itself unless it carries the negative or conjugate bit; then a resolved
    copy (``resolve_conj()`` / ``resolve_neg()``), whose raw bytes are its logical values.

    Raises:
        InvalidArgumentError: See :func:`check_storage`.
    """
    check_storage(t, what)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def check_destination(t: torch.Tensor, what: str) -> torch.Tensor:
    """Check a tensor whose bytes will be overwritten; return it.

    Raises:
        InvalidArgumentError: See :func:`check_storage`; or ``t`` has the negative or
            conjugate bit set (raw bytes written into it would read back negated or
            conjugated).
    """
    check_storage(t, what)
    if t.is_neg() or t.is_conj():
        bit = "negative" if t.is_neg() else "conjugate"
        raise InvalidArgumentError(
            f"{what} has the {bit} bit set (a lazy {bit} view such as "
            f"{'torch._neg_view(x) or x.conj().imag' if bit == 'negative' else 'x.conj()'}): "
            "the copy writes raw bytes, which it would read back "
            f"{'negated' if bit == 'negative' else 'conjugated'}; expected a plain tensor "
            "(allocate one with torch.empty_like, or resolve_neg()/resolve_conj() first)"
        )
    return t
