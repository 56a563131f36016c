"""Zero-copy pickle plane: frames the server can load, chunk lookup without unpickling."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
import torch

from lmcache_kv_fast.dataplane.pickle_fast import ChunkFrameBuilder, locate_chunks
from lmcache_kv_fast.errors import ProtocolError

CASES = [((2, 4, 256, 1024), torch.bfloat16), ((3, 256, 576), torch.float32),
         ((2, 28, 16, 64), torch.float16), ((1, 2, 16, 8), torch.int8),
         ((2, 1, 16, 3), torch.float64)]


def _fill(builder, frame, offsets, chunks):
    flat = torch.frombuffer(frame, dtype=torch.uint8)
    for c, o in zip(chunks, offsets, strict=True):
        flat[o:o + builder.nbytes].copy_(c.reshape(-1).view(torch.uint8))
    return flat


@pytest.mark.parametrize("shape, dtype", CASES)
@pytest.mark.parametrize("n", [1, 3])
def test_built_frame_is_what_the_server_loads(shape, dtype, n):
    b = ChunkFrameBuilder(shape, dtype)
    chunks = [torch.randn(shape).to(dtype) for _ in range(n)]
    backing, frame, offsets = b.build(n)
    flat = _fill(b, frame, offsets, chunks)
    assert all((flat.data_ptr() + o) % 64 == 0 for o in offsets)
    payload = msgspec.msgpack.decode(frame)  # the frame is one msgpack bin document
    objs = pickle.loads(payload)  # exactly what the server does with it
    assert isinstance(objs, list) and len(objs) == n
    for got, want in zip(objs, chunks, strict=True):
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # and our own reader finds the chunks in it
    spans = locate_chunks(memoryview(payload), n, chunks[0].numel(), dtype, "t")
    assert spans is not None and len(spans) == n
    del backing


@pytest.mark.parametrize("shape, dtype", CASES)
def test_locate_in_server_style_pickles(shape, dtype):
    chunks = [torch.randn(shape).to(dtype) for _ in range(3)]
    data = pickle.dumps([c.clone() for c in chunks])  # what the server sends
    mv = memoryview(data)
    spans = locate_chunks(mv, 3, chunks[0].numel(), dtype, "prepare_retrieve")
    assert spans is not None
    for (off, ln), c in zip(spans, chunks, strict=True):
        assert bytes(mv[off:off + ln]) == c.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_wrong_count_or_dtype_is_an_error():
    data = pickle.dumps([torch.zeros(2, 8), torch.zeros(2, 8)])
    with pytest.raises(ProtocolError, match="expected 3"):
        locate_chunks(memoryview(data), 3, 16, torch.float32, "t")
    with pytest.raises(ProtocolError, match="elements"):
        locate_chunks(memoryview(data), 2, 8, torch.float32, "t")
    with pytest.raises(ProtocolError, match="storage"):
        locate_chunks(memoryview(data), 2, 16, torch.bfloat16, "t")


class Gadget:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("make", [
    lambda p: pickle.dumps([Gadget(p)]),
    lambda p: pickle.dumps([1, 2]),
    lambda p: pickle.dumps({"a": torch.zeros(2)}),
    lambda p: b"\x80\x04garbage",
    lambda p: pickle.dumps([torch.zeros(4, 4).t()]),  # non-contiguous: general path
])
def test_anything_else_falls_back_without_executing(tmp_path, make):
    marker = tmp_path / "pwned"
    assert locate_chunks(memoryview(make(str(marker))), 1, 16, torch.float32, "t") is None
    assert not marker.exists()
