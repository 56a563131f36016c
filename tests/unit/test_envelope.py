"""0.5.7 inline plane: envelope frames the server decodes, and a strict zero-copy locator."""

from __future__ import annotations

import pickle
import random
import struct
from typing import Annotated, Literal

import msgspec
import pytest
import torch

from lmcache_kv_fast.dataplane.envelope import EnvelopeFrameBuilder, locate_tensors
from lmcache_kv_fast.errors import InvalidArgumentError, ProtocolError

CASES = [((2, 4, 256, 1024), torch.bfloat16), ((3, 256, 576), torch.float32),
         ((2, 28, 16, 64), torch.float16), ((1, 2, 16, 8), torch.int8),
         ((2, 1, 16, 3), torch.float64), ((2, 61, 256, 128), torch.float8_e4m3fn)]


# The server's own types (lmcache 0.5.7rc2 mp/transfer_context/tensor_wire.py:16-42).
class TensorFrame(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=16)]
    data: memoryview


class TensorEnvelope(msgspec.Struct, forbid_unknown_fields=True):
    version: Literal[1]
    tensors: Annotated[list[TensorFrame], msgspec.Meta(max_length=65536)]


def _chunks(shape, dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(-1).view(dtype)
            .reshape(shape) if dtype.itemsize == 1 else
            torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def _fill(builder, frame, offsets, chunks):
    flat = torch.frombuffer(frame, dtype=torch.uint8)
    for c, o in zip(chunks, offsets, strict=True):
        flat[o:o + builder.nbytes].copy_(c.reshape(-1).view(torch.uint8))
    return flat


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _env(chunks, name=None, shape=None):
    """What the server sends: msgspec's encoding of the envelope."""
    return msgspec.msgpack.encode({"version": 1, "tensors": [
        {"dtype": name or str(c.dtype).removeprefix("torch."),
         "shape": list(shape or c.shape), "data": _raw(c)} for c in chunks]})


@pytest.mark.parametrize("shape, dtype", CASES)
@pytest.mark.parametrize("n", [1, 3, 17])
def test_built_frame_is_what_the_server_decodes(shape, dtype, n):
    b = EnvelopeFrameBuilder(shape, dtype)
    assert b.align == 64
    chunks = _chunks(shape, dtype, n)
    backing, frame, offsets = b.build(n)
    flat = _fill(b, frame, offsets, chunks)
    assert all((flat.data_ptr() + o) % 64 == 0 for o in offsets)
    payload = msgspec.msgpack.decode(frame)  # the ZMQ frame is one msgpack bin document
    env = msgspec.msgpack.decode(payload, type=TensorEnvelope)  # what the server does
    assert env.version == 1 and len(env.tensors) == n
    for got, want in zip(env.tensors, chunks, strict=True):
        assert got.dtype == str(dtype).removeprefix("torch.") and got.shape == shape
        assert bytes(got.data) == _raw(want)
    # our own locator finds them where the builder put them
    hdr = len(frame) - len(payload)
    spans = locate_tensors(payload, n, shape, dtype, "t")
    assert spans == [(o - hdr, b.nbytes) for o in offsets]
    del backing


@pytest.mark.parametrize("shape, dtype", [((1,), torch.uint8), ((200,), torch.uint8),
                                          ((300,), torch.uint8), ((70000,), torch.uint8),
                                          ((2, 3, 16, 8), torch.bfloat16), ((4, 300, 9), torch.int16)])
@pytest.mark.parametrize("n", [0, 1, 2, 15, 16, 17, 300])
def test_unaligned_frame_equals_msgspec_byte_for_byte(shape, dtype, n):
    """bin8/16/32 (inner and outer), fixarray/array16, fixint/uint8/uint16 dims."""
    if n * torch.Size(shape).numel() * dtype.itemsize > 64 << 20:
        pytest.skip("too large for a unit test")
    b = EnvelopeFrameBuilder(shape, dtype, align=1)
    chunks = _chunks(shape, dtype, n, seed=n)
    _backing, frame, offsets = b.build(n)
    _fill(b, frame, offsets, chunks)
    assert bytes(frame) == msgspec.msgpack.encode(_env(chunks, str(dtype)[6:], shape))


@pytest.mark.parametrize("total", [200, 255, 256, 300, 65535, 65536, 70000])
def test_outer_header_holds_the_length_at_every_size(total):
    """Frames whose envelope length is near the bin8/bin16/bin32 limits stay valid and aligned."""
    for nbytes in range(max(1, total - 140), total - 20):
        b = EnvelopeFrameBuilder((1, nbytes), torch.uint8)
        _backing, frame, offsets = b.build(1)
        flat = torch.frombuffer(frame, dtype=torch.uint8)
        assert (flat.data_ptr() + offsets[0]) % b.align == 0 and b.align >= 32
        payload = msgspec.msgpack.decode(frame)
        assert len(frame) - len(payload) in (2, 3, 5)
        assert msgspec.msgpack.decode(payload, type=TensorEnvelope).tensors[0].shape == (1, nbytes)


def test_odd_shapes_still_aligned_to_at_least_32():
    for shape in [(3, 7, 5), (2, 1, 1, 1), (1, 1, 3), (2, 5, 7, 9)]:
        b = EnvelopeFrameBuilder(shape, torch.float32)
        assert b.align in (32, 64)
        _backing, frame, offsets = b.build(5)
        base = torch.frombuffer(frame, dtype=torch.uint8).data_ptr()
        assert all((base + o) % b.align == 0 for o in offsets)
        assert len(msgspec.msgpack.decode(msgspec.msgpack.decode(frame),
                                          type=TensorEnvelope).tensors) == 5


def test_buffers_are_reused_after_release():
    b = EnvelopeFrameBuilder((2, 2, 16, 64), torch.bfloat16)
    backing, _, _ = b.build(4)
    b.release(backing)
    again, _, _ = b.build(4)
    assert again is backing
    other, _, _ = b.build(4)  # the first is in use: a new one
    assert other is not backing


def test_builder_refuses_what_the_server_cannot_take():
    with pytest.raises(InvalidArgumentError, match="at most 16"):
        EnvelopeFrameBuilder((1,) * 17, torch.uint8)
    with pytest.raises(InvalidArgumentError, match="per tensor"):
        EnvelopeFrameBuilder((2**31 + 1,), torch.uint8)
    b = EnvelopeFrameBuilder((2**30,), torch.uint8)  # 1 GiB chunks: nothing allocated yet
    with pytest.raises(InvalidArgumentError, match="tensors and 17179869184 bytes"):
        b.build(17)
    small = EnvelopeFrameBuilder((4,), torch.uint8)
    with pytest.raises(InvalidArgumentError, match="65536 tensors"):
        small.build(65537)
    with pytest.raises(InvalidArgumentError):
        small.build(-1)


# --------------------------------------------------------------------------- locator
@pytest.mark.parametrize("shape, dtype", CASES[2:])
def test_locate_in_server_style_envelopes(shape, dtype):
    chunks = _chunks(shape, dtype, 3, seed=5)
    data = _env(chunks)
    mv = memoryview(data)
    spans = locate_tensors(mv, 3, shape, dtype, "prepare_retrieve")
    assert [bytes(mv[o:o + n]) for o, n in spans] == [_raw(c) for c in chunks]


def test_any_key_order_is_the_same_envelope():
    c = _chunks((2, 1, 4, 8), torch.float16, 2)
    data = msgspec.msgpack.encode({"tensors": [
        {"data": _raw(t), "shape": [2, 1, 4, 8], "dtype": "float16"} for t in c], "version": 1})
    spans = locate_tensors(data, 2, (2, 1, 4, 8), torch.float16, "t")
    assert [bytes(data[o:o + n]) for o, n in spans] == [_raw(t) for t in c]


SHAPE, DTYPE = (2, 1, 4, 8), torch.float16
GOOD = [{"dtype": "float16", "shape": list(SHAPE), "data": bytes(range(128))} for _ in range(3)]


def _bad(**change):
    tensors = [dict(t) for t in GOOD]
    env = {"version": 1, "tensors": tensors}
    for k, v in change.items():
        if k.startswith("t2_"):
            tensors[2][k[3:]] = v
        elif k.startswith("t_"):
            for t in tensors:
                t[k[2:]] = v
        else:
            env[k] = v
    return msgspec.msgpack.encode(env)


def _case_id(v: object) -> str:
    """A case's id: its match text (a frame's bytes may hold a pickled tensor's address,
    which differs between xdist workers)."""
    return v if isinstance(v, str) else "frame"


@pytest.mark.parametrize("data, match", [
    (_bad(version=2), "expected version 1, got 2"),
    (_bad(version="1"), "expected a msgpack uint"),
    (_bad(tensors=GOOD[:2]), "expected 3 tensors, got 2"),
    (_bad(tensors=GOOD * 2), "expected 3 tensors, got 6"),
    (_bad(t_dtype="bfloat16"), "expected tensor 0 of dtype 'float16', got 'bfloat16'"),
    (_bad(t2_dtype="float32"), "expected tensor 2 of dtype 'float16', got 'float32'"),
    (_bad(t_shape=[2, 1, 8, 4]), r"expected tensor 0 of shape \[2, 1, 4, 8\], got \[2, 1, 8, 4\]"),
    (_bad(t_shape=[1, 2, 1, 4, 8]), "got 5 dimensions"),
    (_bad(t_shape=[2, 1, 4, -8]), "expected a msgpack uint"),
    (_bad(t_shape="2,1,4,8"), "expected a msgpack array"),
    (_bad(t2_data=bytes(127)), "expected tensor 2 of 128 data bytes, got 127"),
    (_bad(t_data=bytes(130)), "expected tensor 0 of 128 data bytes, got 130"),
    (_bad(t_data="x" * 128), "expected a msgpack bin"),
    (_bad(extra=1), "expected a map of the 2 fields"),
    (_bad(t2_extra=0), "expected a map of the 3 fields"),
    (msgspec.msgpack.encode({"version": 1, "tensorz": GOOD}), "got 'tensorz'"),
    (msgspec.msgpack.encode({"tensors": GOOD, "tensors2": 1}), "got 'tensors2'"),
    (msgspec.msgpack.encode([1, GOOD]), "expected a msgpack map"),
    (msgspec.msgpack.encode(GOOD), "expected a msgpack map"),
    (msgspec.msgpack.encode(None), "expected a msgpack map"),
    (b"", "the end of the data"),
    (_bad() + b"\x00", "expected the end of the envelope, got 1 more bytes"),
    # pickle (what 0.5.6 sent) starts with 0x80: a msgpack map of no fields
    (pickle.dumps([torch.zeros(SHAPE, dtype=DTYPE)] * 3), "2 fields .* got 0 fields"),
], ids=_case_id)
def test_hostile_envelopes_are_protocol_errors(data, match):
    with pytest.raises(ProtocolError, match=match):
        locate_tensors(data, 3, SHAPE, DTYPE, "prepare_retrieve")


def test_duplicate_fields_are_refused():
    good = _bad()
    # {"version": 1, "version": 1} in place of {"version": 1, "tensors": ...}
    dup = b"\x82\xa7version\x01\xa7version\x01"
    with pytest.raises(ProtocolError, match=r"one of the fields \['tensors'\], got 'version'"):
        locate_tensors(dup, 3, SHAPE, DTYPE, "t")
    tensor = msgspec.msgpack.encode(GOOD[0])
    twice = tensor.replace(b"\xa5shape", b"\xa5dtype", 1)  # "dtype" key twice
    bad = good.replace(tensor, twice, 1)
    with pytest.raises(ProtocolError, match="one of the fields"):
        locate_tensors(bad, 3, SHAPE, DTYPE, "t")


def test_every_truncation_is_refused():
    data = _bad()
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            locate_tensors(data[:cut], 3, SHAPE, DTYPE, "t")


@pytest.mark.parametrize("data, match", [
    # a bin32 claiming 4 GiB - 1 bytes of data
    (_bad().replace(b"\xa4data\xc4\x80", b"\xa4data\xc6\xff\xff\xff\xff", 1),
     "expected tensor 0 of 128 data bytes, got 4294967295"),
    # a 128-byte bin32 whose bytes are not there
    (b"\x82\xa7version\x01\xa7tensors\x91\x83\xa5dtype\xa7float16\xa5shape\x94\x02\x01\x04\x08"
     b"\xa4data\xc6\x00\x00\x00\x80" + bytes(10), "expected 128 more bytes, got 10"),
    # an array32 of 4 G tensors, a map32 of 4 G fields, a str32 of 4 GiB
    (b"\x82\xa7version\x01\xa7tensors\xdd\xff\xff\xff\xff", "expected 3 tensors, got 4294967295"),
    (b"\xdf\xff\xff\xff\xff", "2 fields"),
    (b"\x82\xdb\xff\xff\xff\xffversion", "more bytes"),
    (b"\x82\xa7version\xcf" + struct.pack(">Q", 2**64 - 1), "expected version 1"),
], ids=_case_id)
def test_huge_lengths_are_refused_without_allocating(data, match):
    with pytest.raises(ProtocolError, match=match):
        locate_tensors(data, 1 if b"\x91" in data else 3, SHAPE, DTYPE, "t")


def test_widened_headers_are_read():
    """Non-narrowest msgpack forms (what the builder writes) read like the narrow ones."""
    b = EnvelopeFrameBuilder(SHAPE, DTYPE)
    _backing, frame, _offsets = b.build(3)
    payload = msgspec.msgpack.decode(frame)
    assert payload != _bad()  # widened somewhere (64-byte alignment)
    assert len(locate_tensors(payload, 3, SHAPE, DTYPE, "t")) == 3


def test_fuzzed_envelopes_raise_only_protocol_errors():
    rng = random.Random(7)
    good = _bad()
    accepted = 0
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            spans = locate_tensors(bytes(data), 3, SHAPE, DTYPE, "t")
        except ProtocolError:
            continue
        accepted += 1  # flips inside the data bytes: still a valid envelope
        assert all(o >= 0 and o + n <= len(data) and n == 128 for o, n in spans)
        assert msgspec.msgpack.decode(bytes(data), type=TensorEnvelope).version == 1
    assert 0 < accepted < 3000


def test_lower_alignment_when_the_first_header_has_no_room(monkeypatch):
    """The fallback (never seen with real shapes): align halves, cached frame heads go."""
    b = EnvelopeFrameBuilder(SHAPE, DTYPE)
    assert b.align == 64
    b.build(2)  # a cached frame head for 2 chunks at 64
    real = b._lead
    monkeypatch.setattr(b, "_lead", lambda n, outer: None if b.align == 64 else real(n, outer))
    for n in (3, 2):
        _backing, frame, offsets = b.build(n)
        assert b.align == 32
        base = torch.frombuffer(frame, dtype=torch.uint8).data_ptr()
        assert all((base + o) % 32 == 0 for o in offsets)
        env = msgspec.msgpack.decode(msgspec.msgpack.decode(frame), type=TensorEnvelope)
        assert len(env.tensors) == n and all(len(t.data) == 128 for t in env.tensors)
