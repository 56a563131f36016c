"""A hostile or broken peer (tests/reliability/fake_peer.py) cannot make the client hang,
crash, corrupt data or run code: every case is a bounded KVCacheSDKError on that call, the
caller's tensors and the segment are untouched, and the next call works.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_peer import FakePeer, Geometry, Request, Snapshot, enc, mappings
from rel_helpers import dealer_messages, install_frame_watch, one_frame_messages

import lmcache_kv_fast as lkf
from lmcache_kv_fast.copy import torch_backend

TIMEOUT = 1.0  # context timeout against the fake peer: "no reply" cases cost this much
C = 16  # the fake peer's chunk size
HERE = Path(__file__).resolve().parent

install_frame_watch()


@pytest.fixture(autouse=True)
def _never_one_frame() -> Iterator[None]:
    yield
    assert one_frame_messages() == [], "the client sent a one-frame message"


@pytest.fixture
def shm_peer() -> Iterator[FakePeer]:
    with FakePeer(shm=True) as p:
        yield p
        assert min(p.frame_counts, default=2) >= 2
        assert p.handler_errors == []


@pytest.fixture
def pickle_peer() -> Iterator[FakePeer]:
    with FakePeer(shm=False) as p:
        yield p
        assert min(p.frame_counts, default=2) >= 2
        assert p.handler_errors == []


def _connect(p: FakePeer, **kw: Any) -> lkf.LMCacheKVCacheContext:
    return lkf.connect(p.url, p.http_url, p.model, timeout=TIMEOUT, **kw)


@contextlib.contextmanager
def _ctx(p: FakePeer, **kw: Any) -> Iterator[lkf.LMCacheKVCacheContext]:
    ctx = _connect(p, **kw)
    try:
        yield ctx
    finally:
        ctx.close()


def _toks(n_chunks: int, seed: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n_chunks * C)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).clone()


# ----------------------------------------------------------------------------- control
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "pickle"])
def test_control_honest_peer_roundtrip(shm: bool) -> None:
    """The fake peer itself is faithful: a store/retrieve round trip is bit-exact."""
    with FakePeer(shm=shm) as p, _ctx(p) as ctx:
        assert ctx.transport == ("shm" if shm else "pickle")
        toks, kv = _toks(3, 1), p.geom.kv(3 * C, seed=1)
        assert ctx.store(kv, toks) is True
        got = ctx.retrieve(toks)
        assert got is not None and torch.equal(_bits(got), _bits(kv))
        assert ctx.lookup(toks) == 3 * C
        if shm:
            assert mappings(p.segment) == 2  # the peer's own + the client's
    if shm:
        assert mappings(p.segment) == 0
    assert dealer_messages() > 0


# ----------------------------------------------------------------------------- SHM slots
def _slots(p: FakePeer, offsets: list[int], **kw: Any) -> list[dict[str, Any]]:
    return [p.slot(o, **kw) for o in offsets]


def _cn(p: FakePeer) -> int:
    return p.geom.chunk_nbytes


SLOT_CASES: dict[str, Callable[[FakePeer, list[int]], list[dict[str, Any]] | Any]] = {
    "beyond_end": lambda p, o: _slots(p, [p.pool_bytes, 0]),
    "straddles_end": lambda p, o: _slots(p, [p.pool_bytes - p.align, 0]),
    "negative_offset": lambda p, o: _slots(p, [-p.align, 0]),
    "offset_2^64-1": lambda p, o: _slots(p, [2**64 - 1, 0]),
    "offset_2^63": lambda p, o: _slots(p, [2**63 - p.align, 0]),
    "overlap_same": lambda p, o: _slots(p, [o[0], o[0]]),
    "overlap_partial": lambda p, o: _slots(p, [o[0], o[0] + p.align]),
    "misaligned": lambda p, o: _slots(p, [o[0] + 100, o[1]]),
    "length_short": lambda p, o: _slots(p, o, length=_cn(p) - 2),
    "length_long": lambda p, o: _slots(p, o, length=2 * _cn(p)),
    "length_zero": lambda p, o: _slots(p, o, length=0),
    "length_negative": lambda p, o: _slots(p, o, length=-_cn(p)),
    "shape_same_numel": lambda p, o: _slots(p, o, shape=[4, 2, C, p.geom.hidden]),
    "shape_flat": lambda p, o: _slots(p, o, shape=[_cn(p) // 2]),
    "shape_negative_dims": lambda p, o: _slots(p, o, shape=[-2, -4, C, p.geom.hidden]),
    "dtype_float16": lambda p, o: _slots(p, o, dtype="float16"),
    "dtype_garbage": lambda p, o: _slots(p, o, dtype="torch.bogus"),
    "too_few_slots": lambda p, o: _slots(p, o[:1]),
    "too_many_slots": lambda p, o: _slots(p, [*o, o[1] + 2 * _cn(p)]),
    "offset_is_str": lambda p, o: [dict(s, offset=str(s["offset"])) for s in _slots(p, o)],
    "length_missing": lambda p, o: [{k: v for k, v in s.items() if k != "length"}
                                    for s in _slots(p, o)],
    "slots_not_list": lambda p, o: {"offset": 0},
}


@pytest.mark.parametrize("hints", [False, True], ids=["nohints", "hints"])
@pytest.mark.parametrize("case", sorted(SLOT_CASES))
def test_retrieve_refuses_bad_slots(shm_peer: FakePeer, case: str, hints: bool) -> None:
    p = shm_peer
    with _ctx(p, read_hints=hints) as ctx:
        toks, kv = _toks(2, 2), p.geom.kv(2 * C, seed=2)
        assert ctx.store(kv, toks)
        honest = [p._objects[k].offset for k in p._chunk_keys({"token_ids": toks}, 0, 2 * C)]
        bad = SLOT_CASES[case](p, honest)
        p.on("prepare_retrieve", lambda r: r.value(
            {"success": True, "data": b"", "context": {"slots": bad}}))
        out = torch.full((2, p.geom.layers, 2 * C, p.geom.hidden), 7.0, dtype=torch.bfloat16)
        before_out, before_seg = _bits(out), p.segment_bytes()
        t0 = time.monotonic()
        with pytest.raises(lkf.ProtocolError):
            ctx.retrieve(toks, out=out)
        assert time.monotonic() - t0 < TIMEOUT
        if hints:  # chunks read early from the store's (honest) slots, the rest untouched
            assert ctx.last_timing.hinted == 0
            for i in range(2):
                got_i = _bits(out)[:, :, i * C:(i + 1) * C]
                assert torch.equal(got_i, _bits(kv)[:, :, i * C:(i + 1) * C]) or \
                    torch.equal(got_i, before_out[:, :, i * C:(i + 1) * C]), \
                    f"chunk {i} of out holds bytes of the bad slots"
        else:
            assert torch.equal(_bits(out), before_out), "out was written before the refusal"
        assert p.segment_bytes() == before_seg
        # locks released even on refusal (commit, or free_lookup_locks if undecodable); the
        # commit is sent without waiting for its reply, on the context's release socket
        deadline = time.monotonic() + 2.0
        while not {"commit_retrieve", "free_lookup_locks"} & set(p.ops()[-3:]) and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        assert {"commit_retrieve", "free_lookup_locks"} & set(p.ops()[-3:])
        got = ctx.retrieve(toks)  # the client keeps working
        assert got is not None and torch.equal(_bits(got), _bits(kv))


def _with_indices(make: Callable[[FakePeer, list[int]], Any]
                  ) -> Callable[[FakePeer, list[int]], dict[str, Any]]:
    return lambda p, o: {"slots": make(p, o), "chunk_indices": [0, 1]}


STORE_CASES: dict[str, Callable[[FakePeer, list[int]], dict[str, Any]]] = {
    **{f"slot_{k}": _with_indices(f)
       for k, f in SLOT_CASES.items() if k not in ("too_few_slots", "too_many_slots")},
    "indices_duplicate": lambda p, o: {"slots": _slots(p, o), "chunk_indices": [0, 0]},
    "indices_out_of_range": lambda p, o: {"slots": _slots(p, o), "chunk_indices": [0, 2]},
    "indices_negative": lambda p, o: {"slots": _slots(p, o), "chunk_indices": [-1, 0]},
    "indices_fewer_than_slots": lambda p, o: {"slots": _slots(p, o), "chunk_indices": [0]},
    "indices_more_than_slots": lambda p, o: {"slots": _slots(p, o[:1]), "chunk_indices": [0, 1]},
    "indices_str": lambda p, o: {"slots": _slots(p, o), "chunk_indices": ["0", "1"]},
}


@pytest.mark.parametrize("case", sorted(STORE_CASES))
def test_store_refuses_bad_slots_before_any_byte_moves(shm_peer: FakePeer, case: str) -> None:
    p = shm_peer
    p.fill_segment(0xAB)
    with _ctx(p) as ctx:
        toks, kv = _toks(2, 3), p.geom.kv(2 * C, seed=3)
        kv_before, seg_before = _bits(kv), p.segment_bytes()
        ctx_reply = STORE_CASES[case](p, [0, 2 * _cn(p)])
        p.on("prepare_store", lambda r: r.value({"context": ctx_reply}))
        t0 = time.monotonic()
        with pytest.raises(lkf.ProtocolError):
            ctx.store(kv, toks)
        assert time.monotonic() - t0 < TIMEOUT
        assert p.segment_bytes() == seg_before, "bytes moved before the refusal"
        assert torch.equal(_bits(kv), kv_before)
        assert "commit_store" not in p.ops()
        # the client keeps working: the next store (honest) round-trips
        toks2, kv2 = _toks(2, 4), p.geom.kv(2 * C, seed=4)
        assert ctx.store(kv2, toks2)
        got = ctx.retrieve(toks2)
        assert got is not None and torch.equal(_bits(got), _bits(kv2))


# ----------------------------------------------------------------------------- pickle data
class _Gadget:
    """Unpickling this would create the marker file (code execution)."""

    def __init__(self, marker: Path, how: str = "open") -> None:
        self.marker, self.how = marker, how

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "system":
            return (os.system, (f"touch {self.marker}",))
        if self.how == "eval":
            return (eval, (f"open({str(self.marker)!r}, 'w')",))
        return (open, (str(self.marker), "w"))


class _TensorView:
    """A tensor pickle with an arbitrary view (size/stride/offset) over a real storage."""

    def __init__(self, numel: int, size: tuple[int, ...], stride: tuple[int, ...],
                 offset: int = 0, storage: Any = None) -> None:
        self.numel, self.size, self.stride, self.offset = numel, size, stride, offset
        self.storage = storage

    def __reduce__(self) -> tuple[Any, ...]:
        st = self.storage
        if st is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                st = torch.zeros(self.numel, dtype=torch.bfloat16).storage()
        return (torch._utils._rebuild_tensor_v2,
                (st, self.offset, self.size, self.stride, False, collections.OrderedDict()))


class _StorageBytes:
    """A storage record whose bytes are chosen by the test (for torch.load / the parser)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.storage._load_from_bytes, (self.raw,))


class _Recursive(list):
    pass


def _legacy_save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def _pickle_cases(g: Geometry, marker: Path) -> dict[str, bytes]:
    shape = tuple(g.object_shape)
    numel = g.chunk_nbytes // 2
    strides = tuple(torch.empty(shape).stride())
    good = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    rec: list[Any] = []
    rec.append(rec)
    pk = lambda o: pickle.dumps(o, protocol=4)  # noqa: E731
    valid = pk(good)
    return {
        "gadget_open": pk(_Gadget(marker)),
        "gadget_system": pk(_Gadget(marker, "system")),
        "gadget_eval": pk(_Gadget(marker, "eval")),
        "gadget_in_list_with_tensors": pk([good[0], _Gadget(marker)]),
        "gadget_as_tensor_arg": pk([_TensorView(numel, shape, strides, storage=_Gadget(marker)),
                                    good[1]]),
        "gadget_in_storage_bytes": pk([_TensorView(numel, shape, strides,
                                                   storage=_StorageBytes(_legacy_save(
                                                       _Gadget(marker)))), good[1]]),
        "gadget_in_storage_header": pk([_TensorView(numel, shape, strides, storage=_StorageBytes(
            b"\x80\x02ctorch\nBFloat16Storage\n)R.")), good[1]]),
        "dict": pk({"a": good[0]}),
        "str": pk("hello"),
        "int": pk(42),
        "none": pk(None),
        "list_of_ints": pk([1, 2]),
        "tuple_of_tensors": pk(tuple(good)),
        "nested_lists": pk([[good[0]], [good[1]]]),
        "recursive_list": pk(rec),
        "count_short": pk(good[:1]),
        "count_long": pk([*good, good[0]]),
        "dtype_float16": pk([t.half() for t in good]),
        "dtype_float32": pk([t.float() for t in good]),
        "shape_same_numel": pk([t.view(4, 2, C, g.hidden) for t in good]),
        "shape_flat": pk([t.view(-1) for t in good]),
        "numel_short": pk([t.view(-1)[:-1].clone() for t in good]),
        "view_beyond_storage": pk([_TensorView(16, shape, strides), good[1]]),
        "view_offset_beyond_storage": pk([_TensorView(numel, shape, strides, offset=8),
                                          good[1]]),
        "view_negative_stride": pk([_TensorView(numel, shape, (-strides[0], *strides[1:])),
                                    good[1]]),
        "view_huge_size": pk([_TensorView(16, (1 << 40,), (1,)), good[1]]),
        "truncated": valid[: len(valid) // 2],
        "garbage": os.urandom(4096),
        "empty_list": pk([]),
        "persistent_id": b"\x80\x04P1\n.",
        "out_of_band_buffer": pickle.dumps([pickle.PickleBuffer(b"x" * 64)], protocol=5,
                                           buffer_callback=lambda b: False),
    }


_PICKLE_CASE_NAMES = sorted(_pickle_cases(Geometry(), Path("/nonexistent")))


@pytest.mark.parametrize("case", _PICKLE_CASE_NAMES)
def test_retrieve_refuses_hostile_pickle(pickle_peer: FakePeer, case: str, tmp_path: Path) -> None:
    p = pickle_peer
    marker = tmp_path / "pwned"
    data = _pickle_cases(p.geom, marker)[case]
    with _ctx(p) as ctx:
        toks, kv = _toks(2, 5), p.geom.kv(2 * C, seed=5)
        assert ctx.store(kv, toks)
        p.on("prepare_retrieve", lambda r: r.value({"success": True, "data": data, "context": {}}))
        out = torch.full((2, p.geom.layers, 2 * C, p.geom.hidden), 3.0, dtype=torch.bfloat16)
        before = _bits(out)
        t0 = time.monotonic()
        with pytest.raises(lkf.ProtocolError):
            ctx.retrieve(toks, out=out)
        assert time.monotonic() - t0 < TIMEOUT
        assert not marker.exists(), "server pickle data executed code in the client"
        assert torch.equal(_bits(out), before)
        got = ctx.retrieve(toks)
        assert got is not None and torch.equal(_bits(got), _bits(kv))


def test_shm_context_refuses_pickle_gadget_too(shm_peer: FakePeer, tmp_path: Path) -> None:
    """An SHM context that gets pickle ``data`` instead of slots reads it just as safely."""
    marker = tmp_path / "pwned"
    with _ctx(shm_peer) as ctx:
        toks = _toks(1, 6)
        assert ctx.store(shm_peer.geom.kv(C, seed=6), toks)
        shm_peer.on("prepare_retrieve", lambda r: r.value(
            {"success": True, "data": pickle.dumps([_Gadget(marker)]), "context": {}}))
        with pytest.raises(lkf.ProtocolError):
            ctx.retrieve(toks)
    assert not marker.exists()


@pytest.mark.parametrize("reply", [
    {"success": True, "data": b"", "context": {}},
    {"success": "yes", "data": b"", "context": {}},
    {"data": b""},
    [True, b"", {}],
])
def test_retrieve_refuses_malformed_response(shm_peer: FakePeer, reply: Any) -> None:
    with _ctx(shm_peer) as ctx:
        toks = _toks(1, 7)
        assert ctx.store(shm_peer.geom.kv(C, seed=7), toks)
        shm_peer.on("prepare_retrieve", lambda r: r.value(reply))
        with pytest.raises(lkf.ProtocolError):
            ctx.retrieve(toks)
        assert ctx.retrieve(toks) is not None


def test_retrieve_refuses_deeply_nested_response(shm_peer: FakePeer) -> None:
    """A prepare_retrieve reply nested 100,000 deep: ProtocolError, not RecursionError.

    (In an unknown field: the typed decoder skips it, recursively.)
    """
    nested = (b"\x84" + enc("success") + b"\xc3" + enc("data") + enc(b"") + enc("context")
              + b"\x80" + enc("extra") + _NESTED_MSGPACK)
    with _ctx(shm_peer) as ctx:
        toks = _toks(1, 9)
        assert ctx.store(shm_peer.geom.kv(C, seed=9), toks)
        shm_peer.on("prepare_retrieve", lambda r: [r.uid, r.op, nested])
        with pytest.raises(lkf.ProtocolError, match="nested too deeply"):
            ctx.retrieve(toks)
        assert ctx.retrieve(toks) is not None


# ----------------------------------------------------------------------------- frames
def _cross_wired(p: FakePeer) -> None:
    """Answer the lookup with silence, then the wait with the lookup's uid."""
    held: list[Request] = []

    def on_lookup(r: Request) -> None:
        held.append(r)

    def on_wait(r: Request) -> list[bytes]:
        return [held[0].uid, r.op, enc(1)]

    p.on("lookup", on_lookup)  # type: ignore[arg-type]
    p.on("wait_prefetch_status", on_wait)


#: msgpack nested 100,000 deep (fixarrays of one element), a few hundred KiB
_NESTED_MSGPACK = b"\x91" * 100_000 + b"\x01"

FRAME_CASES: dict[str, tuple[Callable[[FakePeer], None], type[Exception]]] = {
    "msgpack_nested_100000_deep": (lambda p: p.on("wait_prefetch_status",
                                                  lambda r: [r.uid, r.op, _NESTED_MSGPACK]),
                                   lkf.ProtocolError),
    "lookup_reply_nested_deep": (lambda p: p.on("lookup",
                                                lambda r: [r.uid, r.op, _NESTED_MSGPACK]),
                                 lkf.ProtocolError),
    "wrong_uid": (lambda p: p.on("lookup", lambda r: [enc(987654321), r.op]),
                  lkf.ServerTimeoutError),
    "uid_of_other_request": (_cross_wired, lkf.ProtocolError),
    "wrong_op_echo": (lambda p: p.on("lookup", lambda r: [r.uid, enc(99)]), lkf.ProtocolError),
    "op_echo_by_name": (lambda p: p.on("lookup", lambda r: [r.uid, enc("lookup")]),
                        lkf.ProtocolError),
    "empty_op_frame": (lambda p: p.on("lookup", lambda r: [r.uid, b""]), lkf.ProtocolError),
    "one_frame_reply": (lambda p: p.on("lookup", lambda r: [r.uid]), lkf.ProtocolError),
    "undecodable_msgpack": (lambda p: p.on("lookup", lambda r: [r.uid, r.op, b"\xc1"]),
                            lkf.ProtocolError),
    "truncated_msgpack": (lambda p: p.on("wait_prefetch_status",
                                         lambda r: [r.uid, r.op, b"\xcd\x01"]),
                          lkf.ProtocolError),
    "extra_frames": (lambda p: p.on("lookup", lambda r: [r.uid, r.op, enc(None), b"x"]),
                     lkf.ProtocolError),
    "no_reply": (lambda p: p.on("lookup", lambda r: None), lkf.ServerTimeoutError),
    "late_reply": (lambda p: p.on("lookup", lambda r: p.send_later(r.ident, r.none(), 1.5)),
                   lkf.ServerTimeoutError),
    "wait_bool": (lambda p: p.on("wait_prefetch_status", lambda r: r.value(True)),
                  lkf.ProtocolError),
    "wait_str": (lambda p: p.on("wait_prefetch_status", lambda r: r.value("2")),
                 lkf.ProtocolError),
    "wait_negative": (lambda p: p.on("wait_prefetch_status", lambda r: r.value(-1)),
                      lkf.ProtocolError),
    "wait_too_many_hits": (lambda p: p.on("wait_prefetch_status", lambda r: r.value(3)),
                           lkf.ProtocolError),
    "wait_huge_int": (lambda p: p.on("wait_prefetch_status", lambda r: r.value(2**64 - 1)),
                      lkf.ProtocolError),
    "wait_none_forever": (lambda p: p.always.__setitem__("wait_prefetch_status",
                                                         lambda r: r.none()),
                          lkf.ServerTimeoutError),
}


@pytest.mark.parametrize("case", sorted(FRAME_CASES))
def test_malformed_frames_fail_that_call_only(shm_peer: FakePeer, case: str) -> None:
    p = shm_peer
    with _ctx(p) as ctx:
        toks = _toks(2, 8)
        assert ctx.store(p.geom.kv(2 * C, seed=8), toks)
        script, exc = FRAME_CASES[case]
        script(p)
        t0 = time.monotonic()
        with pytest.raises(exc):
            ctx.lookup(toks)
        took = time.monotonic() - t0
        assert took < 2 * TIMEOUT + 1.0, f"{case} took {took:.2f}s"
        p.always.pop("wait_prefetch_status", None)
        time.sleep(0.6 if case == "late_reply" else 0)  # the late reply lands meanwhile
        assert ctx.lookup(toks) == 2 * C  # the next call works
        assert ctx.lookup(toks) == 2 * C


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "pickle"])
def test_silent_commit_is_bounded_and_honest(shm: bool) -> None:
    """commit_store never answered: one timeout, then the store verifies by lookup and says
    False (never True for data the server may not have); the next store works."""
    with FakePeer(shm=shm) as p, _ctx(p) as ctx:
        p.on("commit_store", lambda r: None)
        toks = _toks(2, 13)
        t0 = time.monotonic()
        res = ctx.store_ex(p.geom.kv(2 * C, seed=13), toks)
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        assert not res.ok and res.chunks_refused == 2
        toks2, kv2 = _toks(2, 14), p.geom.kv(2 * C, seed=14)
        assert ctx.store(kv2, toks2)
        got = ctx.retrieve(toks2)
        assert got is not None and torch.equal(_bits(got), _bits(kv2))


def test_silent_prepare_is_one_timeout(shm_peer: FakePeer) -> None:
    with _ctx(shm_peer) as ctx:
        shm_peer.on("prepare_store", lambda r: None)
        t0 = time.monotonic()
        with pytest.raises(lkf.ServerTimeoutError, match="prepare_store"):
            ctx.store(shm_peer.geom.kv(C, seed=15), _toks(1, 15))
        assert time.monotonic() - t0 < TIMEOUT + 1.0
        assert ctx.store(shm_peer.geom.kv(C, seed=16), _toks(1, 16))


def test_duplicate_and_unsolicited_replies_are_dropped(shm_peer: FakePeer) -> None:
    p = shm_peer
    with _ctx(p) as ctx:
        toks = _toks(2, 9)
        assert ctx.store(p.geom.kv(2 * C, seed=9), toks)
        p.on("lookup", lambda r: [r.none(), r.none(), r.value("again")])
        flood = [[enc(i), enc(24), os.urandom(64)] for i in range(1000)]
        p.on("wait_prefetch_status", lambda r: [*flood, r.value(2), r.value(2)])
        assert ctx.lookup(toks) == 2 * C
        assert ctx.lookup(toks) == 2 * C
        assert ctx.retrieve(toks) is not None


def test_huge_reply_frame_is_bounded(shm_peer: FakePeer) -> None:
    """A 64 MiB garbage reply to a small call is refused, not trusted."""
    with _ctx(shm_peer) as ctx:
        toks = _toks(1, 10)
        assert ctx.store(shm_peer.geom.kv(C, seed=10), toks)
        shm_peer.on("wait_prefetch_status", lambda r: [r.uid, r.op, b"\xc6" + (64 << 20).to_bytes(4, "big")
                                                        + bytes(64 << 20)])
        with pytest.raises(lkf.ProtocolError):
            ctx.lookup(toks)
        assert ctx.lookup(toks) == C


def test_forgotten_registration_says_reconnect(shm_peer: FakePeer) -> None:
    """A peer that stops answering for our instance and drops it from /status (what a
    restarted server does): the error says to reconnect, and later calls fail fast."""
    p = shm_peer
    with _ctx(p) as ctx:
        toks = _toks(1, 11)
        assert ctx.store(p.geom.kv(C, seed=11), toks)
        p.forget_registrations = True
        with pytest.raises(lkf.KVCacheSDKError, match="reconnect"):
            ctx.store(p.geom.kv(C, seed=12), _toks(1, 12))
        t0 = time.monotonic()
        with pytest.raises(lkf.KVCacheSDKError, match="reconnect"):
            ctx.retrieve(toks)
        assert time.monotonic() - t0 < 0.2
    p.forget_registrations = False
    with _ctx(p) as ctx2:  # a fresh connect works
        assert ctx2.lookup(toks) == C


# ----------------------------------------------------------------------------- connect
def _cfg(**mp: Any) -> Callable[[FakePeer], None]:
    def apply(p: FakePeer) -> None:
        for k, v in mp.items():
            if v is _DEL:
                del p.config["mp"][k]
            else:
                p.config["mp"][k] = v
    return apply


def _chunk(n: int, *, config: bool = True) -> Callable[[FakePeer], None]:
    """The peer's chunk size: ``/status`` (the live one the SDK uses) and ``/config``."""
    def apply(p: FakePeer) -> None:
        p.status_overrides["chunk_size"] = n
        if config:
            p.config["mp"]["chunk_size"] = n
    return apply


def _entry(path: str, value: Any) -> Callable[[FakePeer], None]:
    def apply(p: FakePeer) -> None:
        node: Any = p.cache_context_meta["6814"]
        *parents, last = path.split(".")
        for k in parents:
            node = node[int(k)] if k.isdigit() else node[k]
        if value is _DEL:
            del node[last]
        else:
            node[last] = value
    return apply


def _raw(path: str, code: int, body: bytes, delay: float = 0.0) -> Callable[[FakePeer], None]:
    return lambda p: p.http_raw.__setitem__(path, (code, body, delay))


def _reg(**fields: Any) -> Callable[[FakePeer], None]:
    return lambda p: p.registration.update(fields)


def _symlinked_segment(p: FakePeer) -> None:
    target = Path(f"/tmp/lmckvf_victim_{os.getpid()}")
    target.write_bytes(b"\0" * p.pool_bytes)
    link = f"lmckvf_link_{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{link}")
    os.symlink(target, f"/dev/shm/{link}")
    p.registration.update(shm_name=link)


_DEL = object()
_ABSURD = 10**9
CONNECT_CASES: dict[str, Callable[[FakePeer], None]] = {
    "config_not_json": _raw("/config", 200, b"<html>"),
    "config_list": _raw("/config", 200, b"[1, 2]"),
    "config_no_mp": _raw("/config", 200, b'{"storage_manager": {}}'),
    "config_mp_str": _raw("/config", 200, b'{"mp": "zmq"}'),
    "config_http_500": _raw("/config", 500, b"boom"),
    "config_http_404": _raw("/config", 404, b"{}"),
    "config_too_slow": _raw("/config", 200, b"{}", delay=3.0),
    "config_absurdly_large": _raw("/config", 200, b" " * (17 << 20)),
    "config_nested_100000_deep": _raw("/config", 200, b"[" * 100_000 + b"]" * 100_000),
    "config_mp_nested_deep": _raw("/config", 200, b'{"mp": ' + b'{"a": ' * 100_000 + b"1"
                                  + b"}" * 100_001),
    "chunk_size_missing": _cfg(chunk_size=_DEL),
    "chunk_size_str": _cfg(chunk_size="16"),
    "chunk_size_float": _cfg(chunk_size=16.0),
    "chunk_size_zero": _cfg(chunk_size=0),
    "chunk_size_negative": _cfg(chunk_size=-16),
    "chunk_size_not_block_multiple": _chunk(24),
    "chunk_size_absurd": _chunk(2**40),
    "status_chunk_size_not_block_multiple": _chunk(24, config=False),
    "status_chunk_size_absurd": _chunk(2**40, config=False),
    "status_chunk_size_str": _chunk("16", config=False),  # type: ignore[arg-type]
    "transfer_mode_lmcache_driven": _cfg(supported_transfer_mode="lmcache_driven"),
    "transport_grpc": _cfg(transport="grpc"),
    "align_not_power_of_two": lambda p: p.config["storage_manager"]["l1_manager_config"][
        "memory_config"].__setitem__("align_bytes", 3000),
    "align_str": lambda p: p.config["storage_manager"]["l1_manager_config"][
        "memory_config"].__setitem__("align_bytes", "4096"),
    "version_int": lambda p: setattr(p, "version", 56),
    "version_old": lambda p: setattr(p, "version", "0.4.0"),
    "status_not_object": _raw("/status", 200, b'"ok"'),
    "status_absurdly_large": _raw("/status", 200, b" " * (17 << 20)),
    "status_nested_100000_deep": _raw("/status", 200, b'{"x": ' + b"[" * 100_000
                                      + b"]" * 100_000 + b"}"),
    "status_no_meta": lambda p: p.cache_context_meta.clear(),
    "status_meta_list": _raw("/status", 200, b'{"cache_context_meta": [1]}'),
    "entry_no_layout": _entry("kv_cache_layout", _DEL),
    "entry_layout_str": _entry("kv_cache_layout", "x"),
    "entry_world_size_zero": _entry("world_size", 0),
    "entry_no_kernel_groups": _entry("kv_cache_layout.kernel_groups", _DEL),
    "entry_zero_kernel_groups": _entry("kv_cache_layout.kernel_groups", []),
    "entry_two_kernel_groups": lambda p: p.cache_context_meta["6814"]["kv_cache_layout"][
        "kernel_groups"].append(dict(p.cache_context_meta["6814"]["kv_cache_layout"][
            "kernel_groups"][0], kernel_group_idx=1)),
    "num_layers_str": _entry("kv_cache_layout.num_layers", "4"),
    "num_layers_negative": _entry("kv_cache_layout.num_layers", -4),
    "num_layers_absurd": lambda p: (
        _entry("kv_cache_layout.num_layers", _ABSURD)(p),
        _entry("kv_cache_layout.kernel_groups.0.num_layers", _ABSURD)(p),
        _entry("kv_cache_layout.kernel_groups.0.engine_kv_concrete_shape",
               f"{_ABSURD} x [2, 4, 16, 8, 128]")(p),
        _entry("kv_cache_layout.cache_size_per_token", 2 * _ABSURD * 1024 * 2)(p)),
    "head_size_absurd": lambda p: (
        _entry("kv_cache_layout.kernel_groups.0.engine_kv_concrete_shape",
               f"4 x [2, 4, 16, 8, {_ABSURD}]")(p),
        _entry("kv_cache_layout.cache_size_per_token", 2 * 4 * 8 * _ABSURD * 2)(p)),
    "concrete_shape_garbage": _entry("kv_cache_layout.kernel_groups.0.engine_kv_concrete_shape",
                                     "4 x [2, four, 16]"),
    "concrete_shape_unknown": _entry("kv_cache_layout.kernel_groups.0.engine_kv_concrete_shape",
                                     "Unknown (EngineKVFormat.NL_X_NB_NH_BS_CS)"),
    "format_unknown": _entry("kv_cache_layout.kernel_groups.0.engine_kv_format", "NOPE"),
    "dtype_unknown": _entry("kv_cache_layout.kernel_groups.0.dtype", "torch.complex64"),
    "cache_size_per_token_mismatch": _entry("kv_cache_layout.cache_size_per_token", 12345),
    "slots_per_block_mismatch": _entry("kv_cache_layout.kernel_groups.0.slots_per_block", 8),
    "noop_wrong_answer": lambda p: p.always.__setitem__("noop", lambda r: r.value("NOPE")),
    "noop_silent": lambda p: p.always.__setitem__("noop", lambda r: None),
    "noop_nested_100000_deep": lambda p: p.always.__setitem__(
        "noop", lambda r: [r.uid, r.op, _NESTED_MSGPACK]),
    "register_nested_100000_deep": lambda p: p.always.__setitem__(
        "register_kv_cache_engine_driven_context", lambda r: [r.uid, r.op, _NESTED_MSGPACK]),
    "register_silent": lambda p: p.always.__setitem__(
        "register_kv_cache_engine_driven_context", lambda r: None),
    "register_wrong_types": lambda p: p.always.__setitem__(
        "register_kv_cache_engine_driven_context", lambda r: r.value({"shm_name": 5})),
    "segment_dotdot": _reg(shm_name="../../etc/passwd"),
    "segment_slash": _reg(shm_name="a/b"),
    "segment_abs_path": _reg(shm_name="/dev/shm/../x"),
    "segment_dotdot_only": _reg(shm_name=".."),
    "segment_nul": _reg(shm_name="a\x00b"),
    "segment_missing": _reg(shm_name="lmckvf_does_not_exist"),
    "segment_symlink": _symlinked_segment,
    "pool_size_beyond_segment": _reg(pool_size=2**62),
    "pool_size_negative": _reg(pool_size=-1),
    "pool_smaller_than_a_chunk": _reg(pool_size=4096),
}


@pytest.mark.parametrize("case", sorted(CONNECT_CASES))
def test_connect_refuses_broken_peer(case: str) -> None:
    before = Snapshot.take()
    with FakePeer(shm=True) as p:
        CONNECT_CASES[case](p)
        t0 = time.monotonic()
        with pytest.raises(lkf.KVCacheSDKError) as ei:
            _connect(p).close()
        took = time.monotonic() - t0
        assert took < 2 * TIMEOUT + 0.5, f"{case} took {took:.2f}s"
        assert len(str(ei.value)) > 20  # a message that says something
        assert mappings(p.segment) == 1  # only the peer's own mapping
        assert min(p.frame_counts, default=2) >= 2
    after = Snapshot.take()
    new = {t for t in after.threads - before.threads if "process_request" not in t}
    assert not new, new  # (the peer's own HTTP handler threads may still be sleeping)
    assert after.fds <= before.fds + 2  # pytest's own capture files may come and go
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/lmckvf_link_{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/tmp/lmckvf_victim_{os.getpid()}")


def test_torch_backend_refuses_symlinked_segment(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"\0" * 8192)
    link = f"lmckvf_link2_{os.getpid()}"
    os.symlink(target, f"/dev/shm/{link}")
    try:
        with pytest.raises(OSError):
            torch_backend.open_segment(link, 4096)
    finally:
        os.unlink(f"/dev/shm/{link}")


# ----------------------------------------------------------------------------- nastiest
_NASTY = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {here!r})
    from fake_peer import FakePeer
    import lmcache_kv_fast as lkf

    C = 16
    refused = 0
    with FakePeer(shm=True) as p:
        ctx = lkf.connect(p.url, p.http_url, p.model, timeout=1.0)
        toks = list(range(2 * C))
        kv = p.geom.kv(2 * C)
        assert ctx.store(kv, toks)
        # 1. the server shrinks its segment under the client, then hands out slots in the
        #    vanished part: a copy there would be SIGBUS; it must be refused instead. It
        #    answers late, so the client has read both chunks early from its read hints
        #    (still intact then): the reply must be refused all the same.
        honest = [p._objects[k].offset for k in p._chunk_keys({{"token_ids": toks}}, 0, 2 * C)]
        def shrink_then_slots(r):
            time.sleep(0.3)
            os.truncate(f"/dev/shm/{{p.segment}}", 4096)
            return r.value({{"success": True, "data": b"",
                            "context": {{"slots": [p.slot(o) for o in honest]}}}})
        p.on("prepare_retrieve", shrink_then_slots)
        try:
            ctx.retrieve(toks)
        except lkf.ProtocolError:
            refused += 1
        p.on("prepare_store", lambda r: r.value({{"context": {{
            "slots": [p.slot(0), p.slot(2 * p.geom.chunk_nbytes)], "chunk_indices": [0, 1]}}}}))
        try:
            ctx.store(kv, list(range(1000, 1000 + 2 * C)))
        except lkf.ProtocolError:
            refused += 1
        # 2. slots at the very end of the address space
        p.on("prepare_retrieve", lambda r: r.value({{"success": True, "data": b"",
            "context": {{"slots": [p.slot(2**63 - 4096), p.slot(2**64 - 4096)]}}}}))
        try:
            ctx.retrieve(toks)
        except lkf.ProtocolError:
            refused += 1
        ctx.close()
    print("REFUSED", refused)
""")


def test_nastiest_cases_in_a_subprocess() -> None:
    """SIGBUS-class cases run in a child: it must exit normally, having refused each."""
    code = _NASTY.format(here=str(HERE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE)])}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        for seg in Path("/dev/shm").glob(f"lmckvf_fake_{child.pid}_*"):  # if it died
            seg.unlink(missing_ok=True)
    assert child.returncode == 0, f"child died ({child.returncode}): {stderr[-2000:]}"
    assert "REFUSED 3" in stdout, stdout + stderr[-2000:]
