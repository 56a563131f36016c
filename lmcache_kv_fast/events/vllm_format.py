"""vLLM's KV-events wire format and the mapper from MP-server records to vLLM events.

The structs mirror ``vllm/distributed/kv_events.py`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, and vLLM's ``KVEventBatch`` as :class:`VllmKVEventBatch`, so that
``KVEventBatch`` in this package is only the server's batch a subscription yields);
:func:`encode_vllm_batch` writes the positional (``"array"``) or the tagged-map
(``"map"``) payload. :class:`VllmEventMapper` maps records the way LMCache's vLLM adapter
does (docs/protocol.md §9): ``stored`` ⇒ ``BlockStored`` for hashes not announced yet,
``removed`` ⇒ ``BlockRemoved`` of the announced subset, ``lost`` / a new server
incarnation / a withdraw ⇒ one ``BlockRemoved`` of everything announced.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from lmcache_kv_fast.errors import InvalidArgumentError
from lmcache_kv_fast.events.common import KIND_REMOVED, KIND_STORED, MEDIUM_CPU
from lmcache_kv_fast.protocol import types as _wire
from lmcache_kv_fast.protocol.types import KVEventRecord

logger = logging.getLogger("lmcache_kv_fast.events")


ExternalBlockHash = bytes | int
WireFormat = Literal["array", "map"]


class _VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's tagged KV cache events (``vllm/distributed/kv_events.py``)."""


class BlockStored(_VllmEvent, tag="BlockStored"):
    """vLLM ``BlockStored``: blocks became available in ``medium``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_VllmEvent, tag="BlockRemoved"):
    """vLLM ``BlockRemoved``: blocks left ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    """vLLM ``AllBlocksCleared``."""


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's wire record ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` on the wire.

    Renamed here (the fields and encoding are vLLM's): ``KVEventBatch`` of this package is
    the LMCache server's batch (:class:`lmcache_kv_fast.events.KVEventBatch`).
    """

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


_VLLM_ENCODER = msgspec.msgpack.Encoder()
_VLLM_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def _event_as_map(ev: VllmEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(ev).__struct_config__.tag}
    for name in ev.__struct_fields__:
        out[name] = getattr(ev, name)
    return out


def encode_vllm_batch(batch: VllmKVEventBatch, wire_format: WireFormat = "array") -> bytes:
    """Encode a batch as vLLM's publisher does.

    Args:
        batch: The batch.
        wire_format: ``"array"`` - every struct positional (``array_like``), as vLLM up to
            0.23 and its ``kv_events_subscriber.py`` example; ``"map"`` - the batch
            positional, each event a map with a ``"type"`` tag, as vLLM after PR #42892.

    Returns:
        The msgpack payload frame.
    """
    if wire_format == "array":
        return _VLLM_ENCODER.encode(batch)
    if wire_format == "map":
        return _VLLM_ENCODER.encode(
            [batch.ts, [_event_as_map(e) for e in batch.events], batch.data_parallel_rank])
    raise InvalidArgumentError(f"wire_format must be 'array' or 'map', got {wire_format!r}")


def decode_vllm_batch(payload: bytes) -> VllmKVEventBatch:
    """Decode a positional (``"array"``) vLLM batch payload (for tests and tools)."""
    return _VLLM_DECODER.decode(payload)


def _int_hash(h: bytes) -> int:
    """Return the hash as vLLM's ``maybe_convert_block_hash`` does with int hashes on."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class VllmEventMapper:
    """Turn MP-server records into vLLM events like LMCache's vLLM adapter (docs/protocol.md §9).

    Keeps the set of announced hashes: ``stored`` ⇒ one ``BlockStored`` per record for its
    hashes not announced yet (records without token ids are skipped); ``removed`` ⇒ one
    ``BlockRemoved`` of the announced subset; ``lost``, a changed incarnation or
    :meth:`withdraw_all` ⇒ one ``BlockRemoved`` of everything announced (sorted). Records
    of another medium are ignored.

    Args:
        block_size: ``block_size`` of ``BlockStored`` (the server's chunk size).
        int_block_hashes: Publish hashes as ints (low 64 bits), like vLLM with
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``; default raw 32-byte hashes.
    """

    def __init__(self, block_size: int, *, int_block_hashes: bool = False) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.int_block_hashes = int_block_hashes
        self.announced: set[bytes] = set()
        self.incarnation: int | None = None

    def _ext(self, h: bytes) -> ExternalBlockHash:
        return _int_hash(h) if self.int_block_hashes else h

    def on_batch(self, batch: _wire.WireKVEventBatch) -> list[VllmEvent]:
        """Map one server batch (withdraw first when it says so)."""
        out: list[VllmEvent] = []
        changed = getattr(batch, "incarnation_changed", False) or (
            self.incarnation is not None and batch.incarnation != self.incarnation)
        if changed or batch.lost:
            reason = "server restart" if changed else "events lost"
            out.extend(self.withdraw_all(reason))
        self.incarnation = batch.incarnation
        out.extend(self.on_records(batch.events))
        return out

    def on_records(self, records: Sequence[KVEventRecord]) -> list[VllmEvent]:
        """Map records (server or SDK announcements) in order."""
        out: list[VllmEvent] = []
        for r in records:
            if r.medium != MEDIUM_CPU:
                continue
            if r.kind == KIND_STORED:
                new = [h for h in r.block_hashes if h not in self.announced]
                if not new or not r.token_ids:
                    continue
                self.announced.update(new)
                parent = r.parent_block_hash
                out.append(BlockStored(
                    block_hashes=[self._ext(h) for h in new],
                    parent_block_hash=None if parent is None else self._ext(parent),
                    token_ids=list(r.token_ids), block_size=self.block_size, lora_id=None,
                    medium=MEDIUM_CPU, lora_name=None,
                ))
            elif r.kind == KIND_REMOVED:
                gone = [h for h in r.block_hashes if h in self.announced]
                if not gone:
                    continue
                self.announced.difference_update(gone)
                out.append(BlockRemoved(block_hashes=[self._ext(h) for h in gone],
                                        medium=MEDIUM_CPU))
            else:
                logger.warning("ignoring KV event record of unknown kind %r", r.kind)
        return out

    def withdraw_all(self, reason: str = "resync") -> list[VllmEvent]:
        """Forget everything announced; return the ``BlockRemoved`` that says so (or [])."""
        if not self.announced:
            return []
        logger.warning("withdrawing %d announced KV blocks (%s)", len(self.announced), reason)
        hashes = sorted(self.announced)
        self.announced.clear()
        return [BlockRemoved(block_hashes=[self._ext(h) for h in hashes], medium=MEDIUM_CPU)]
