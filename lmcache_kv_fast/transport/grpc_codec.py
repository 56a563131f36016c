"""gRPC messages of the server's services, per generation (docs/protocol.md §12).

``lmcache server --transport grpc`` serves the same operations as the ZMQ loop, one RPC
each, in proto package ``lmcache.mp``; 0.5.6 and 0.5.7 name their services differently
(0.5.6 ``ControllerService`` / ``DebugService`` / ``ObservabilityService``, 0.5.7
``ManagementService`` / ``KVEventService``) and differ in a few fields (``token_ids`` ->
``token_bytes``, ``skipped_chunks``, ``extra_ranges``, ``null_block_id``).

The ``.proto`` files of both generations are kept in ``grpc_protos/`` and compiled by
``scripts/gen-grpc.sh`` into one ``FileDescriptorSet`` each (``v056.binpb``,
``v057.binpb``). Each set is loaded into a ``DescriptorPool`` of its own, so the two
generations' identically named messages never meet in protobuf's default pool and no
generated ``_pb2`` module exists. This module maps each :class:`Op`'s payloads (the
msgspec values the flows hand to ``Channel.send``) to its request message, and each
response message to the value the ZMQ reply frame would hold, which ``Channel.wait``
then checks against the flow's msgspec type exactly as it decodes a ZMQ frame.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec

from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import GEN_056, GEN_057, Generation, Op
from lmcache_kv_fast.protocol.types import IPCCacheServerKey, PackedTokensKey

__all__ = ["Dialect", "Method", "dialect_for", "payload_of_raw", "to_type"]

PROTO_DIR = Path(__file__).with_name("grpc_protos")
PACKAGE = "lmcache.mp"

#: What a response message becomes (see :func:`_reader`): nothing (an empty message, a
#: 2-frame ZMQ reply), one field's value, or a map of every field (a msgspec Struct).
NONE, STRUCT = "", "*"

# op -> (service key, RPC method, request fields in payload order, response reader).
# Service keys are resolved per generation by _SERVICES. A request field "*" means the
# one payload is a Struct whose fields are the message's fields.
_OPS: dict[Op, tuple[str, str, tuple[str, ...], str]] = {
    Op.REGISTER_ENGINE_DRIVEN: ("engine", "RegisterKvCacheEngineDrivenContext", ("*",), STRUCT),
    Op.UNREGISTER_ENGINE_DRIVEN: ("engine", "UnregisterKvCacheEngineDrivenContext",
                                  ("instance_id",), NONE),
    Op.PREPARE_STORE: ("engine", "PrepareStore", ("key", "instance_id", "skipped_chunks"), STRUCT),
    Op.COMMIT_STORE: ("engine", "CommitStore", ("key", "instance_id", "data"), "success"),
    Op.PREPARE_RETRIEVE: ("engine", "PrepareRetrieve", ("key", "instance_id"), STRUCT),
    Op.COMMIT_RETRIEVE: ("engine", "CommitRetrieve", ("key", "instance_id"), "success"),
    Op.LOOKUP: ("lookup", "Lookup", ("key", "tp_size"), NONE),
    Op.QUERY_PREFETCH_STATUS: ("lookup", "QueryPrefetchStatus", ("request_id",), "chunk_count"),
    Op.WAIT_PREFETCH_STATUS: ("lookup", "WaitPrefetchStatus", ("request_id", "timeout"),
                              "chunk_count"),
    Op.FREE_LOOKUP_LOCKS: ("lookup", "FreeLookupLocks", ("key", "tp_size", "extra_ranges"), NONE),
    Op.END_SESSION: ("lookup", "EndSession", ("request_id",), NONE),
    Op.CLEAR: ("manage", "Clear", ("force",), NONE),
    Op.GET_CHUNK_SIZE: ("manage", "GetChunkSize", (), "chunk_size"),
    Op.NEGOTIATE_CHUNK_SIZE: ("manage", "NegotiateChunkSize", ("required_chunk_alignment",),
                              "chunk_size"),
    Op.PING: ("manage", "Ping", ("instance_id",), "ok"),
    Op.NOOP: ("debug", "Noop", (), "message"),
    Op.GET_EXPERIMENTAL: ("manage", "GetExperimental", (), "names"),
    Op.SUBSCRIBE_KV_EVENTS: ("events", "SubscribeKvEvents",
                             ("instance_id", "model_name", "cursor", "max_events"), STRUCT),
}

# generation tag -> service key -> service name (package-qualified below)
_SERVICES: dict[str, dict[str, str]] = {
    "v056": {"engine": "EngineDrivenService", "lookup": "LookupService",
             "manage": "ControllerService", "debug": "DebugService",
             "events": "ObservabilityService"},
    "v057": {"engine": "EngineDrivenService", "lookup": "LookupService",
             "manage": "ManagementService", "debug": "ManagementService",
             "events": "KVEventService"},
}
_TAGS = {GEN_056.name: "v056", GEN_057.name: "v057"}


@dataclass(frozen=True)
class Method:
    """One RPC of a generation: how to build its request and read its response.

    Attributes:
        op: The operation.
        path: ``/lmcache.mp.<Service>/<Method>``, as ``grpc.Channel.unary_unary`` takes it.
        request: Request message class (of the generation's own pool).
        response: Response message class.
        fields: Request fields in payload order.
        reader: Response reader (``NONE``, ``STRUCT`` or a field name).
        streaming: Server-streaming RPC (``SubscribeKvEvents``).
    """

    op: Op
    path: str
    request: type
    response: type
    fields: tuple[str, ...]
    reader: str
    streaming: bool = False

    def encode(self, payloads: Sequence[Any], raw: Sequence[Any] = ()) -> Any:
        """The request message of ``payloads`` (``raw``: the msgpack ``bin`` data frame).

        Raises:
            ProtocolError: More payloads than the message has fields, or a value the
                field cannot hold (an internal error: the flows send what the table says).
        """
        values = list(payloads) + [payload_of_raw(f) for f in raw]
        if len(values) > len(self.fields):
            raise ProtocolError(f"{self.op.value}: {len(values)} payloads for the gRPC "
                                f"request's {len(self.fields)} fields {self.fields}")
        msg = self.request()
        try:
            for name, value in zip(self.fields, values):
                _set(msg, name, value)
        except (TypeError, ValueError, AttributeError) as err:
            raise ProtocolError(f"{self.op.value}: cannot encode its gRPC request: {err}") from err
        return msg

    def decode(self, msg: Any) -> Any:
        """The value a ZMQ reply of this operation would carry (None: no payload).

        Raises:
            ProtocolError: An ``encoded_*`` field is not a msgpack map.
        """
        if self.reader == NONE:
            return None
        if self.reader == STRUCT:
            return _message_dict(msg, self.op.value)
        return _field_value(msg, msg.DESCRIPTOR.fields_by_name[self.reader], self.op.value)


@dataclass(frozen=True)
class Dialect:
    """The RPCs of one server generation (its own descriptor pool).

    Attributes:
        name: Generation name (``"0.5.6"``, ``"0.5.7"``).
        methods: Every RPC this SDK uses, by operation.
    """

    name: str
    methods: Mapping[Op, Method]

    def method(self, op: Op) -> Method:
        """The RPC of ``op``.

        Raises:
            KeyError: This generation's gRPC services have no such operation (like
                ``Generation.op_frame_value``: never sent).
        """
        try:
            return self.methods[op]
        except KeyError:
            raise KeyError(f"operation {op.value!r} has no gRPC method in server generation "
                           f"{self.name}") from None


def dialect_for(gen: Generation) -> Dialect:
    """The gRPC dialect of server generation ``gen``.

    Raises:
        KVCacheSDKError: ``gen`` has no gRPC transport this SDK speaks (before 0.5.6).
    """
    tag = _TAGS.get(gen.name)
    if tag is None:
        raise KVCacheSDKError(
            f"this SDK speaks the gRPC transport of LMCache 0.5.6 and 0.5.7 only; the server "
            f"is {gen.name}: use its ZMQ transport (tcp://)"
        )
    return _load(tag, gen.name)


@functools.cache
def _load(tag: str, name: str) -> Dialect:
    pool = _pool(tag)
    from google.protobuf import message_factory

    services = _SERVICES[tag]
    methods: dict[Op, Method] = {}
    for op, (skey, rpc, fields, reader) in _OPS.items():
        try:
            svc = pool.FindServiceByName(f"{PACKAGE}.{services[skey]}")
        except KeyError:  # pragma: no cover - the committed descriptor sets have them all
            continue
        md = svc.methods_by_name.get(rpc)
        if md is None:
            continue  # e.g. NegotiateChunkSize before 0.5.7
        req = message_factory.GetMessageClass(md.input_type)
        resp = message_factory.GetMessageClass(md.output_type)
        have = set(req.DESCRIPTOR.fields_by_name)
        fields = tuple(f for f in fields if f == "*" or f in have)  # e.g. no skipped_chunks
        methods[op] = Method(op, f"/{svc.full_name}/{rpc}", req, resp, fields, reader,
                             md.server_streaming)
    return Dialect(name, MappingProxyType(methods))


def _pool(tag: str) -> Any:
    """A fresh ``DescriptorPool`` holding the generation's committed descriptor set."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    data = (PROTO_DIR / f"{tag}.binpb").read_bytes()
    fds = descriptor_pb2.FileDescriptorSet.FromString(data)
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:
        pool.Add(fd)
    return pool


# -- requests ------------------------------------------------------------------------
def payload_of_raw(frame: Any) -> memoryview:
    """The bytes inside an already-encoded msgpack ``bin`` frame (``commit_store``'s data).

    Raises:
        ProtocolError: ``frame`` is not one msgpack ``bin`` value.
    """
    view = memoryview(frame).cast("B")
    if not view:
        raise ProtocolError("commit_store data frame is empty, expected a msgpack bin")
    tag = view[0]
    head = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(tag)
    if head is None or len(view) < 1 + head:
        raise ProtocolError(f"commit_store data frame starts with 0x{tag:02x}, expected a "
                            "msgpack bin (0xc4..0xc6)")
    n = int.from_bytes(view[1:1 + head], "big")
    if len(view) != 1 + head + n:
        raise ProtocolError(f"commit_store data frame holds {len(view)} bytes, its bin "
                            f"header says {1 + head + n}")
    return view[1 + head:]


def _set(msg: Any, name: str, value: Any) -> None:
    """Write one payload into its request field."""
    if name == "*":
        _fill_struct(msg, value)
    elif value is None:
        return  # an optional field left unset (proto3 presence), as upstream's codec does
    elif isinstance(value, (IPCCacheServerKey, PackedTokensKey)):
        _write_key(getattr(msg, name), value)
        getattr(msg, name).SetInParent()
    elif name == "skipped_chunks":
        for idx in value:
            msg.skipped_chunks.add().indices.extend(idx)
    elif name == "extra_ranges":
        for start, end in value:
            r = msg.extra_ranges.add()
            r.start, r.end = start, end
    elif isinstance(value, memoryview):
        setattr(msg, name, value.tobytes())
    else:
        setattr(msg, name, value)


def _fill_struct(msg: Any, value: msgspec.Struct) -> None:
    have = msg.DESCRIPTOR.fields_by_name
    for f in value.__struct_fields__:
        v = getattr(value, f)
        if f not in have:
            raise ValueError(f"{type(value).__name__}.{f} has no field in "
                             f"{msg.DESCRIPTOR.full_name}")
        if v is not None:
            setattr(msg, f, v)


def _write_key(m: Any, key: IPCCacheServerKey | PackedTokensKey) -> None:
    """Fill an ``IpcCacheServerKey`` message from a key of either dialect.

    ``request_configs`` travels msgpack-encoded in ``encoded_request_configs``: unset for
    None, empty for an empty map (as upstream's codec).
    """
    m.model_name = key.model_name
    m.world_size = key.world_size
    if key.worker_id is not None:
        m.worker_id = key.worker_id
    if isinstance(key, PackedTokensKey):
        m.token_bytes = key.token_bytes
    else:
        m.token_ids.extend(key.token_ids)
    m.start, m.end = key.start, key.end
    m.request_id = key.request_id
    m.cache_salt = key.cache_salt
    if key.request_configs is not None:
        m.encoded_request_configs = codec.encode(key.request_configs) if key.request_configs \
            else b""
    m.num_kv_readers = key.num_kv_readers


# -- responses -----------------------------------------------------------------------
def _message_dict(msg: Any, what: str) -> dict[str, Any]:
    """Every field of ``msg``: ``encoded_x`` becomes ``x`` (decoded msgpack map)."""
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        name = fd.name.removeprefix("encoded_")
        out[name] = _field_value(msg, fd, what)
    return out


def _field_value(msg: Any, fd: Any, what: str) -> Any:
    if fd.has_presence and fd.message_type is None and not msg.HasField(fd.name):
        return None
    v = getattr(msg, fd.name)
    if fd.name.startswith("encoded_"):
        return _decode_map(v, f"{what} {fd.name}")
    if fd.message_type is not None:
        if _is_repeated(fd):
            return [_message_dict(m, what) for m in v]
        return _message_dict(v, what)
    if _is_repeated(fd):
        return list(v)
    if isinstance(v, bytes) and fd.name == "data":
        return memoryview(v)  # the inline data plane reads it in place
    return v


def _is_repeated(fd: Any) -> bool:
    rep = getattr(fd, "is_repeated", None)  # protobuf >= 5.28; `label` before
    return bool(rep) if rep is not None else fd.label == fd.LABEL_REPEATED


def _decode_map(data: bytes, what: str) -> dict[str, Any]:
    if not data:
        return {}
    value = codec.decode(data, Any, what=what)
    if not isinstance(value, dict):
        raise ProtocolError(f"malformed reply to {what}: expected a msgpack map, got "
                            f"{type(value).__name__}")
    return value


def to_type(value: Any, tp: Any, what: str) -> Any:
    """``value`` as the flow's msgspec type ``tp``, as strictly as a ZMQ frame is decoded.

    Raises:
        ProtocolError: It does not fit.
    """
    if tp is None or tp is Any:
        return value
    try:
        return msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError as err:
        raise ProtocolError(f"malformed reply to {what}: expected {tp!r}: {err}") from err
