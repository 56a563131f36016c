"""The restricted unpickler: tensors in, nothing else."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from lmcache_kv_fast.dataplane.pickle_plane import dumps_chunks, safe_loads_chunks
from lmcache_kv_fast.errors import ProtocolError


def test_roundtrip_server_style():
    chunks = [torch.randn(2, 3, 16, 8).to(torch.bfloat16) for _ in range(3)]
    data = pickle.dumps([c.clone() for c in chunks])  # what the server sends
    got = safe_loads_chunks(data, 3, 2 * 3 * 16 * 8, torch.bfloat16, "t")
    assert all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))
    assert pickle.loads(dumps_chunks(chunks))[1].equal(chunks[1])


class Gadget:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_reduce_gadget_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    data = pickle.dumps([Gadget(str(marker))])
    with pytest.raises(ProtocolError, match="refused"):
        safe_loads_chunks(data, 1, 1, torch.float32, "prepare_retrieve")
    assert not marker.exists()


@pytest.mark.parametrize("obj", [[1, 2], {"a": torch.zeros(2)}, "x", [torch.zeros(2), None]])
def test_non_tensor_objects_refused(obj):
    with pytest.raises(ProtocolError):
        safe_loads_chunks(pickle.dumps(obj), 2, 2, torch.float32, "t")


@pytest.mark.parametrize("chunks, count, numel, dtype", [
    ([torch.zeros(4)], 1, 8, torch.float32),        # wrong size
    ([torch.zeros(8)], 1, 8, torch.bfloat16),       # wrong dtype
    ([torch.zeros(8)], 2, 8, torch.float32),        # wrong count
])
def test_wrong_tensor_refused(chunks, count, numel, dtype):
    with pytest.raises(ProtocolError):
        safe_loads_chunks(pickle.dumps(chunks), count, numel, dtype, "t")


def test_garbage_refused():
    with pytest.raises(ProtocolError):
        safe_loads_chunks(b"\x80\x04not a pickle", 1, 1, torch.float32, "t")
