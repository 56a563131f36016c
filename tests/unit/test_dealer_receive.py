"""``Dealer.receive_within``: a blocking receive bounded by ``RCVTIMEO``, on real sockets.

A ROUTER on 127.0.0.1 stands in for the peer (no LMCache server needed): the channel's
wait loop receives replies this way (one slice at most, then it checks close and its
deadline), and the non-blocking :meth:`Dealer.receive` must stay non-blocking.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from lmcache_kv_fast.transport.zmq_socket import Dealer


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, Dealer]]:
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = Dealer(zctx, f"tcp://127.0.0.1:{port}", events=0)
    try:
        yield router, dealer
    finally:
        dealer.close()
        router.close(0)
        zctx.term()


def _reply_to_next(router: zmq.Socket, frames: list[bytes]) -> None:
    ident = router.recv_multipart()[0]
    router.send_multipart([ident, *frames])


def test_nothing_within_the_timeout_is_none(pair: tuple[zmq.Socket, Dealer]) -> None:
    _, dealer = pair
    t = time.monotonic()
    assert dealer.receive_within(30) is None
    assert 0.02 <= time.monotonic() - t < 2.0


def test_a_message_is_its_frames(pair: tuple[zmq.Socket, Dealer]) -> None:
    router, dealer = pair
    dealer.send([b"uid", b"op"], "test")
    _reply_to_next(router, [b"uid", b"op", b"payload"])
    frames = dealer.receive_within(2000)
    assert frames is not None
    assert [f.bytes for f in frames] == [b"uid", b"op", b"payload"]


def test_the_timeout_does_not_make_receive_block(pair: tuple[zmq.Socket, Dealer]) -> None:
    router, dealer = pair
    dealer.send([b"u2", b"op"], "test")
    _reply_to_next(router, [b"u2", b"op"])
    got = dealer.receive_within(3000)  # RCVTIMEO now 3 s
    assert got is not None and [f.bytes for f in got] == [b"u2", b"op"]
    t = time.monotonic()
    assert dealer.receive() is None
    assert time.monotonic() - t < 1.5  # NOBLOCK: not the 3 s a blocking receive would take
