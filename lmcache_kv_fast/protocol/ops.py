"""Operation identifiers per server generation (docs/protocol.md §2.4, Appendices A and C).

Each server generation has exactly one table, defined once here and chosen once per
context. The SDK only ever sends operations that are in the table of the server it
talks to: an old id can execute a *different* operation on a newer server (docs/protocol.md Appendix A).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Op(str, enum.Enum):
    """Operations the SDK uses; the value is the operation's name on the wire."""

    REGISTER_KV_CACHE = "register_kv_cache"
    UNREGISTER_KV_CACHE = "unregister_kv_cache"
    LOOKUP = "lookup"
    QUERY_PREFETCH_STATUS = "query_prefetch_status"
    WAIT_PREFETCH_STATUS = "wait_prefetch_status"
    FREE_LOOKUP_LOCKS = "free_lookup_locks"
    END_SESSION = "end_session"
    REGISTER_ENGINE_DRIVEN = "register_kv_cache_engine_driven_context"
    UNREGISTER_ENGINE_DRIVEN = "unregister_kv_cache_engine_driven_context"
    PREPARE_STORE = "prepare_store"
    COMMIT_STORE = "commit_store"
    PREPARE_RETRIEVE = "prepare_retrieve"
    COMMIT_RETRIEVE = "commit_retrieve"
    CLEAR = "clear"
    GET_CHUNK_SIZE = "get_chunk_size"
    PING = "ping"
    NOOP = "noop"
    GET_EXPERIMENTAL = "get_experimental"
    SUBSCRIBE_KV_EVENTS = "subscribe_kv_events"
    NEGOTIATE_CHUNK_SIZE = "negotiate_chunk_size"


# 0.5.3 .. 0.5.6 legacy integer table (0.5.6 `wire.py`); ops added later have names only.
_IDS_053: dict[Op, int] = {
    Op.REGISTER_KV_CACHE: 1,
    Op.UNREGISTER_KV_CACHE: 2,
    Op.LOOKUP: 8,
    Op.QUERY_PREFETCH_STATUS: 9,
    Op.WAIT_PREFETCH_STATUS: 10,
    Op.FREE_LOOKUP_LOCKS: 12,
    Op.END_SESSION: 13,
    Op.REGISTER_ENGINE_DRIVEN: 14,
    Op.UNREGISTER_ENGINE_DRIVEN: 15,
    Op.PREPARE_STORE: 16,
    Op.COMMIT_STORE: 17,
    Op.PREPARE_RETRIEVE: 18,
    Op.COMMIT_RETRIEVE: 19,
    Op.CLEAR: 20,
    Op.GET_CHUNK_SIZE: 21,
    Op.PING: 22,
    Op.NOOP: 24,
}

# 0.5.1 / 0.5.2 `RequestType` enum positions (docs/protocol.md Appendix A, left column).
_IDS_051: dict[Op, int] = {
    Op.REGISTER_KV_CACHE: 1,
    Op.UNREGISTER_KV_CACHE: 2,
    Op.LOOKUP: 5,
    Op.QUERY_PREFETCH_STATUS: 6,
    Op.WAIT_PREFETCH_STATUS: 7,
    Op.FREE_LOOKUP_LOCKS: 9,
    Op.END_SESSION: 10,
    Op.REGISTER_ENGINE_DRIVEN: 11,
    Op.UNREGISTER_ENGINE_DRIVEN: 12,
    Op.PREPARE_STORE: 13,
    Op.COMMIT_STORE: 14,
    Op.PREPARE_RETRIEVE: 15,
    Op.COMMIT_RETRIEVE: 16,
    Op.CLEAR: 17,
    Op.GET_CHUNK_SIZE: 18,
    Op.PING: 19,
    Op.NOOP: 21,
}


@dataclass(frozen=True)
class Generation:
    """One server generation's wire dialect.

    Attributes:
        name: Human name, e.g. ``"0.5.6"`` or ``"0.5.3-0.5.4"``.
        versions: Server versions of this generation.
        op_ids: Integer id of each operation this generation understands.
        named_ops: Operations only reachable by name (string operation frame).
        clear_takes_force: Whether ``clear`` takes the ``force`` bool payload.
        requires_num_kv_readers: Whether lookups reject keys without ``num_kv_readers``.
        ipc_wrapper_ext: Whether ``register_kv_cache`` descriptors are msgpack ext (else pickle).
        token_bytes_keys: Whether keys carry ``token_bytes`` (packed big-endian uint32)
            instead of ``token_ids`` (0.5.7).
        trailing_payloads: Payloads appended to an operation's own ones: later servers
            grew some signatures by defaulted arguments that must still be sent, since the
            server checks the payload count exactly (0.5.7's ``skipped_chunks`` /
            ``extra_ranges``).
        inline_envelope: Whether the non-SHM plane speaks msgpack ``TensorEnvelope``
            (0.5.7) instead of pickled tensor lists.
        events_capability: Whether ``get_experimental`` lists ``"kv_event_stream"`` when
            the server publishes KV events (0.5.6 only: 0.5.7 lists module features).
    """

    name: str
    versions: tuple[str, ...]
    op_ids: Mapping[Op, int]
    named_ops: frozenset[Op] = field(default_factory=frozenset)
    clear_takes_force: bool = True
    requires_num_kv_readers: bool = True
    ipc_wrapper_ext: bool = True
    token_bytes_keys: bool = False
    trailing_payloads: Mapping[Op, tuple[Any, ...]] = field(
        default_factory=lambda: MappingProxyType({}))
    inline_envelope: bool = False
    events_capability: bool = False

    def payloads(self, op: Op, payloads: Sequence[Any]) -> Sequence[Any]:
        """``payloads`` of ``op`` with this generation's trailing defaults appended."""
        extra = self.trailing_payloads.get(op)
        return payloads if extra is None else (*payloads, *extra)

    def supports(self, op: Op) -> bool:
        """Return whether this generation understands ``op``."""
        return op in self.op_ids or op in self.named_ops

    def op_frame_value(self, op: Op) -> int | str:
        """Return the value to msgpack-encode in the operation frame.

        Raises:
            KeyError: If this generation does not have the operation (never send it).
        """
        if op in self.op_ids:
            return self.op_ids[op]
        if op in self.named_ops:
            return op.value
        raise KeyError(f"operation {op.value!r} does not exist in server generation {self.name}")


GEN_051 = Generation(
    name="0.5.1-0.5.2",
    versions=("0.5.1", "0.5.2"),
    op_ids=MappingProxyType(_IDS_051),
    clear_takes_force=False,
    requires_num_kv_readers=False,
    ipc_wrapper_ext=False,
)
GEN_053 = Generation(
    name="0.5.3-0.5.4",
    versions=("0.5.3", "0.5.4"),
    op_ids=MappingProxyType(_IDS_053),
    clear_takes_force=False,
    requires_num_kv_readers=False,
    ipc_wrapper_ext=False,  # DeviceIPCWrapper.Serialize is pickle up to 0.5.5
)
GEN_055 = Generation(
    name="0.5.5",
    versions=("0.5.5",),
    op_ids=MappingProxyType(_IDS_053),
    clear_takes_force=False,
    ipc_wrapper_ext=False,
)
GEN_056 = Generation(
    name="0.5.6",
    versions=("0.5.6",),
    op_ids=MappingProxyType(_IDS_053),
    named_ops=frozenset({Op.GET_EXPERIMENTAL, Op.SUBSCRIBE_KV_EVENTS}),
    events_capability=True,
)
GEN_057 = Generation(
    name="0.5.7",
    versions=("0.5.7",),
    op_ids=MappingProxyType(_IDS_053),
    named_ops=frozenset({Op.GET_EXPERIMENTAL, Op.SUBSCRIBE_KV_EVENTS,
                         Op.NEGOTIATE_CHUNK_SIZE}),
    token_bytes_keys=True,
    # prepare_store(key, iid, skipped_chunks=()), free_lookup_locks(key, tp, extra_ranges=())
    trailing_payloads=MappingProxyType({Op.PREPARE_STORE: ((),), Op.FREE_LOOKUP_LOCKS: ((),)}),
    inline_envelope=True,
)

#: Known generations, oldest first. The newest is tried for unknown newer servers.
GENERATIONS: tuple[Generation, ...] = (GEN_051, GEN_053, GEN_055, GEN_056, GEN_057)
NEWEST = GEN_057


def known_versions() -> str:
    """The server versions this SDK speaks, for error messages (``"0.5.1 .. 0.5.7"``)."""
    return f"{GENERATIONS[0].versions[0]} .. {NEWEST.versions[-1]}"


def generation_for(version: str) -> Generation | None:
    """Return the generation of a ``major.minor.patch`` server version, or None.

    Suffixes are ignored (``"0.5.4.post1"``, ``"0.5.6-g3e11e108"``).
    """
    parsed = parse_version(version)
    if parsed is None or len(parsed) < 3:
        return None
    core = ".".join(str(p) for p in parsed[:3])
    for gen in GENERATIONS:
        if core in gen.versions:
            return gen
    return None


_VERSION_RE = re.compile(r"v?(\d+(?:\.\d+)+)")


def parse_version(version: str) -> tuple[int, ...] | None:
    """Parse ``"0.5.6-g3e11e108"`` into ``(0, 5, 6)``; None if it is not a version.

    Only the leading dotted numbers count: ``"0.5.7.dev3+gabc"`` is ``(0, 5, 7)``.
    """
    m = _VERSION_RE.match(version.strip().strip('"'))
    if m is None:
        return None
    return tuple(int(p) for p in m.group(1).split("."))
