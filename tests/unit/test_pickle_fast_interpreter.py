"""The closed tensor-pickle interpreter of the pickle plane, opcode by opcode.

Pins what ``_interpret`` does with each opcode it reads, that every other opcode, global
and call is refused, and that no read goes past the buffer; a seeded fuzz checks that
mangled streams only ever fall back (None) or fail cleanly, never point outside the buffer.
"""

from __future__ import annotations

import pickle
import random
import struct

import msgspec
import pytest
import torch

from lmcache_kv_fast.dataplane.pickle_fast import (
    ChunkFrameBuilder,
    _Bytes,
    _interpret,
    _TensorRef,
    _Unsupported,
    locate_chunks,
)
from lmcache_kv_fast.errors import ProtocolError

P = pickle
SUPPORTED = {
    P.PROTO, P.FRAME, P.EMPTY_LIST, P.EMPTY_TUPLE, P.EMPTY_DICT, P.MARK, P.POP, P.POP_MARK,
    P.MEMOIZE, P.BINPUT, P.LONG_BINPUT, P.BINGET, P.LONG_BINGET, P.SHORT_BINUNICODE,
    P.BINUNICODE, P.STACK_GLOBAL, P.GLOBAL, P.BINBYTES, P.BINBYTES8, P.SHORT_BINBYTES,
    P.BININT1, P.BININT2, P.BININT, P.LONG1, P.NEWFALSE, P.NEWTRUE, P.NONE, P.TUPLE1,
    P.TUPLE2, P.TUPLE3, P.TUPLE, P.REDUCE, P.APPEND, P.APPENDS, P.STOP,
}


def run(*parts: bytes) -> object:
    return _interpret(memoryview(b"".join(parts)))


def u8(v: int) -> bytes:
    return bytes([v])


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def sbu(s: str) -> bytes:
    raw = s.encode()
    return P.SHORT_BINUNICODE + u8(len(raw)) + raw


ODICT = P.GLOBAL + b"collections\nOrderedDict\n"
LOAD = P.GLOBAL + b"torch.storage\n_load_from_bytes\n"
REBUILD = P.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n"


# --------------------------------------------------------------------------- each opcode
@pytest.mark.parametrize("stream, want", [
    ([P.PROTO, b"\x04", P.FRAME, struct.pack("<Q", 3), P.NONE, P.STOP], None),
    ([P.EMPTY_LIST, P.STOP], []),
    ([P.EMPTY_TUPLE, P.STOP], ()),
    ([P.EMPTY_DICT, P.STOP], {}),
    ([P.NONE, P.MARK, P.BININT1, b"\x01", P.NEWTRUE, P.POP_MARK, P.STOP], None),
    ([P.NONE, P.NEWTRUE, P.POP, P.STOP], None),
    ([P.NEWFALSE, P.STOP], False),
    ([P.NEWTRUE, P.STOP], True),
    ([P.BININT1, b"\xff", P.STOP], 255),
    ([P.BININT2, b"\xff\xff", P.STOP], 65535),
    ([P.BININT, struct.pack("<i", -5), P.STOP], -5),
    ([P.LONG1, b"\x06", (-(2**40)).to_bytes(6, "little", signed=True), P.STOP], -(2**40)),
    ([P.LONG1, b"\x00", P.STOP], 0),
    ([sbu("abc"), P.STOP], "abc"),
    ([P.BINUNICODE, u32(6), "héllo".encode(), P.STOP], "héllo"),
    ([P.NONE, P.TUPLE1, P.STOP], (None,)),
    ([P.BININT1, b"\x01", P.BININT1, b"\x02", P.TUPLE2, P.STOP], (1, 2)),
    ([P.BININT1, b"\x01", P.BININT1, b"\x02", P.BININT1, b"\x03", P.TUPLE3, P.STOP], (1, 2, 3)),
    ([P.MARK, P.BININT1, b"\x01", P.NONE, P.NEWTRUE, P.NEWFALSE, P.TUPLE, P.STOP],
     (1, None, True, False)),
    ([P.MARK, P.TUPLE, P.STOP], ()),
    ([P.EMPTY_LIST, P.BININT1, b"\x07", P.APPEND, P.STOP], [7]),
    ([P.EMPTY_LIST, P.MARK, P.BININT1, b"\x01", P.BININT1, b"\x02", P.APPENDS, P.STOP], [1, 2]),
    ([P.EMPTY_LIST, P.MARK, P.APPENDS, P.STOP], []),
    # memo: MEMOIZE fills a list, BINPUT / LONG_BINPUT a map that BINGET looks in first
    ([P.BININT1, b"\x07", P.MEMOIZE, P.POP, P.BINGET, b"\x00", P.STOP], 7),
    ([P.BININT1, b"\x07", P.MEMOIZE, P.POP, P.LONG_BINGET, u32(0), P.STOP], 7),
    ([P.BININT1, b"\x07", P.BINPUT, b"\x09", P.POP, P.BINGET, b"\x09", P.STOP], 7),
    ([P.BININT1, b"\x07", P.LONG_BINPUT, u32(300), P.POP, P.LONG_BINGET, u32(300), P.STOP], 7),
    ([P.BININT1, b"\x01", P.MEMOIZE, P.BININT1, b"\x02", P.BINPUT, b"\x00", P.BINGET, b"\x00",
      P.TUPLE3, P.STOP], (1, 2, 2)),
    # globals resolve to names, never to objects; only the three of a tensor pickle
    ([ODICT, P.STOP], ("collections", "OrderedDict")),
    ([sbu("torch._utils"), sbu("_rebuild_tensor_v2"), P.STACK_GLOBAL, P.STOP],
     ("torch._utils", "_rebuild_tensor_v2")),
    ([LOAD, P.STOP], ("torch.storage", "_load_from_bytes")),
    ([ODICT, P.EMPTY_TUPLE, P.REDUCE, P.STOP], {}),
    ([sbu("collections"), sbu("OrderedDict"), P.STACK_GLOBAL, P.EMPTY_TUPLE, P.REDUCE, P.STOP],
     {}),
    ([P.NONE, P.STOP, b"anything after STOP is not read"], None),
])
def test_each_opcode(stream, want):
    got = run(*stream)
    assert got == want and type(got) is type(want)


def test_memo_returns_the_same_object():
    a, b = run(P.EMPTY_LIST, P.MEMOIZE, P.BINGET, b"\x00", P.TUPLE2, P.STOP)
    assert a == [] and a is b


@pytest.mark.parametrize("head, n", [
    (P.SHORT_BINBYTES + u8(5), 5), (P.BINBYTES + u32(5), 5),
    (P.BINBYTES8 + struct.pack("<Q", 5), 5), (P.SHORT_BINBYTES + u8(0), 0),
])
def test_bytes_are_located_not_copied(head, n):
    got = run(P.NONE, P.POP, head, b"x" * n, P.STOP)
    assert got == _Bytes(2 + len(head), n)


def test_storage_and_tensor_calls():
    storage = [LOAD, P.SHORT_BINBYTES, u8(4), b"abcd", P.TUPLE1, P.REDUCE]
    assert run(*storage, P.STOP) == _Bytes(len(LOAD) + 2, 4)

    def rebuild(size, stride, grad=P.NEWFALSE, hooks=(ODICT, P.EMPTY_TUPLE, P.REDUCE),
                extra=()):
        dims = [P.MARK, *(P.BININT + struct.pack("<i", d) for d in size), P.TUPLE]
        steps = [P.MARK, *(P.BININT + struct.pack("<i", d) for d in stride), P.TUPLE]
        return run(REBUILD, P.MARK, *storage, P.BININT1, b"\x03", *dims, *steps, grad, *hooks,
                   *extra, P.TUPLE, P.REDUCE, P.STOP)

    want = _TensorRef(_Bytes(len(REBUILD) + 1 + len(LOAD) + 2, 4), 3, (2, 1), (1, 1))
    assert rebuild((2, 1), (1, 1)) == want
    assert rebuild((2, 1), (1, 1), extra=[P.NONE]) == want  # the 7-argument form
    for bad in ({"grad": P.NEWTRUE}, {"hooks": [P.EMPTY_LIST]}, {"hooks": [P.NONE]},
                {"size": (2, -1)}, {"stride": (-1, 1)}):
        args = {"size": (2, 1), "stride": (1, 1), **bad}
        with pytest.raises(_Unsupported, match="unexpected tensor arguments"):
            rebuild(**args)


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_whole_tensor_lists_at_every_protocol(protocol):
    ts = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.zeros(4, dtype=torch.int8)]
    data = pickle.dumps(ts, protocol=protocol)
    got = _interpret(memoryview(data))
    assert [(r.size, r.stride, r.storage_offset) for r in got] == [((2, 3), (3, 1), 0),
                                                                  ((4,), (1,), 0)]
    with pytest.raises(ProtocolError, match="expected 1 chunk tensors, got 2"):
        locate_chunks(memoryview(data), 1, 6, torch.float32, "t")
    one = pickle.dumps(ts[:1], protocol=protocol)
    ((off, n),) = locate_chunks(memoryview(one), 1, 6, torch.float32, "t")
    assert one[off:off + n] == ts[0].numpy().tobytes()


def test_protocol_2_bytes_are_a_call_and_refused():
    data = pickle.dumps([torch.zeros(2)], protocol=2)  # bytes via _codecs.encode(str, enc)
    with pytest.raises(_Unsupported, match="global _codecs.encode"):
        _interpret(memoryview(data))


# --------------------------------------------------------------------------- closedness
@pytest.mark.parametrize("op", [bytes([k]) for k in range(256) if bytes([k]) not in SUPPORTED])
def test_every_other_opcode_is_refused(op):
    with pytest.raises(_Unsupported, match=f"opcode 0x{op[0]:02x}"):
        run(P.PROTO, b"\x04", op, b"\x00" * 16, P.STOP)


@pytest.mark.parametrize("stream, match", [
    ([P.GLOBAL, b"os\nsystem\n"], "global os.system"),
    ([sbu("os"), sbu("system"), P.STACK_GLOBAL], "global os.system"),
    ([sbu("builtins"), sbu("eval"), P.STACK_GLOBAL], "global builtins.eval"),
    ([P.GLOBAL, b"collections\nOrderedDict2\n"], "global collections.OrderedDict2"),
    ([P.NONE, P.EMPTY_TUPLE, P.REDUCE], "call of None"),
    ([ODICT, P.NONE, P.TUPLE1, P.REDUCE], "call of"),
    ([LOAD, P.NONE, P.TUPLE1, P.REDUCE], "call of"),
    ([REBUILD, P.EMPTY_TUPLE, P.REDUCE], "call of"),
    ([P.NONE, P.POP_MARK], "no mark"),
    ([P.NONE, P.TUPLE], "no mark"),
    ([P.EMPTY_LIST, P.APPENDS], "no mark"),
    ([P.NONE, P.NONE, P.APPEND], "append to a non-list"),
    ([P.NONE, P.MARK, P.APPENDS], "appends to a non-list"),
    ([P.NONE, P.NONE, P.STOP], "unbalanced stack at STOP"),
    ([P.STOP], "unbalanced stack at STOP"),
    ([P.SHORT_BINBYTES, b"\x05abcd"], "bytes beyond the buffer"),
    ([P.BINBYTES, u32(5), b"abcd"], "bytes beyond the buffer"),
    ([P.BINBYTES8, struct.pack("<Q", 2**64 - 1), b"abcd"], "bytes beyond the buffer"),
    ([], "no STOP"),
    ([P.NONE], "no STOP"),
    ([P.PROTO], "no STOP"),
    ([P.FRAME, b"\x00\x00"], "no STOP"),
    ([P.SHORT_BINUNICODE, b"\x09abc"], "no STOP"),  # a string past the end: never returned
    ([P.BINUNICODE, u32(9), b"abc"], "no STOP"),
    ([P.LONG1, b"\x09\x01"], "no STOP"),
])
def test_refused_streams(stream, match):
    with pytest.raises(_Unsupported, match=match):
        run(*stream)
    assert locate_chunks(memoryview(b"".join(stream)), 1, 1, torch.float32, "t") is None


@pytest.mark.parametrize("stream, error", [
    ([P.BINGET, b"\x00", P.STOP], IndexError),  # memo indices are checked
    ([P.NONE, P.MEMOIZE, P.BINGET, b"\x01", P.STOP], IndexError),
    ([P.LONG_BINGET, u32(2**32 - 1), P.STOP], IndexError),
    ([P.POP], IndexError),
    ([P.MEMOIZE], IndexError),
    ([P.NONE, P.BINPUT], struct.error),
    ([P.NONE, P.LONG_BINPUT, b"\x00\x00"], struct.error),
    ([P.BINGET], struct.error),
    ([P.LONG_BINGET, b"\x00"], struct.error),
    ([P.BININT1], IndexError),
    ([P.BININT2, b"\x00"], struct.error),
    ([P.BININT, b"\x00\x00"], struct.error),
    ([P.LONG1], IndexError),
    ([P.SHORT_BINUNICODE], IndexError),
    ([P.BINUNICODE, b"\x00"], struct.error),
    ([P.SHORT_BINBYTES], IndexError),
    ([P.BINBYTES, b"\x00"], struct.error),
    ([P.BINBYTES8, b"\x00"], struct.error),
    ([P.SHORT_BINUNICODE, b"\x02\xff\xfe", P.STOP], UnicodeDecodeError),
    ([P.GLOBAL, b"collections OrderedDict"], ValueError),  # no newline
    ([P.GLOBAL, b"x" * 300 + b"\nOrderedDict\n"], ValueError),  # a module name over 255 bytes
    ([P.NONE, P.TUPLE2], IndexError),
    ([P.NONE, P.NONE, P.TUPLE3], IndexError),
    ([P.TUPLE1], IndexError),
    ([P.NONE, P.REDUCE], IndexError),
    ([P.NONE, P.STACK_GLOBAL], IndexError),
])
def test_truncated_or_inconsistent_streams_raise(stream, error):
    with pytest.raises(error):
        run(*stream)
    assert locate_chunks(memoryview(b"".join(stream)), 1, 1, torch.float32, "t") is None


# --------------------------------------------------------------------------- fuzz
def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(4)
        k = rng.randrange(len(b))
        if kind == 0:
            b[k] = rng.randrange(256)
        elif kind == 1:
            del b[k:k + rng.randint(1, 8)]
        elif kind == 2:
            b[k:k] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            b = b[:k]
        if not b:
            break
    return bytes(b)


def _seeds() -> list[bytes]:
    ts = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + k for k in range(2)]
    builder = ChunkFrameBuilder((2, 3), torch.float32)
    _, frame, _ = builder.build(2)
    return [pickle.dumps(ts, protocol=p) for p in (3, 4, 5)] + \
        [bytes(msgspec.msgpack.decode(frame))]


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_streams_fall_back_or_stay_in_bounds(seed):
    rng = random.Random(seed)
    outcomes = {"spans": 0, "fallback": 0, "error": 0}
    for data in _seeds():
        for _ in range(150):
            bad = _mutate(rng, data)
            try:
                spans = locate_chunks(memoryview(bad), 2, 6, torch.float32, "t")
            except ProtocolError:
                outcomes["error"] += 1
                continue
            if spans is None:
                outcomes["fallback"] += 1
                continue
            outcomes["spans"] += 1
            assert len(spans) == 2
            assert all(off >= 0 and off + n <= len(bad) and n == 24 for off, n in spans)
    # mutations inside the data keep a valid stream; the rest must fall back
    assert outcomes["spans"] > 0 and outcomes["fallback"] > outcomes["spans"]
