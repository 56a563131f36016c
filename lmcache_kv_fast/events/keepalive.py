"""The thread each KV-event subscription runs beside its stream: pings, and its context.

Both subscriptions (ZMQ :mod:`~lmcache_kv_fast.events.stream`, gRPC
:mod:`~lmcache_kv_fast.events.stream_grpc`) call :func:`start_keepalive`. The thread pings
the subscription's instance id with a :class:`~lmcache_kv_fast.transport.heartbeat.Beat`
on a channel of the subscription's own control client, so the server's reaper never
closes a live subscription (docs/protocol.md §3.11), and closes the subscription once the
context it was made from is closed. It holds the subscription only weakly: one dropped
without ``close()`` is garbage-collected and closes itself (``__del__``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import zmq

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.events.endpoint import target_closed, target_reap_timeout
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.transport.heartbeat import Beat, ping_interval

logger = logging.getLogger("lmcache_kv_fast.events")

#: The thread wakes this often (to notice close() and a closed context).
_SLICE_S = 0.1


def start_keepalive(sub: Any, client: Any, target: Any, stop: threading.Event
                    ) -> threading.Thread:
    """Start the keep-alive thread of ``sub``; it ends when ``stop`` is set.

    Args:
        sub: The subscription (``url``, ``instance_id``, ``end_reason``, ``close()``).
        client: Its control client (``ZmqClient`` or ``GrpcClient``), closed by ``sub``
            after this thread ended.
        target: The context or endpoint it was made from.
        stop: Set by ``sub`` when it closes.
    """
    interval = ping_interval(target_reap_timeout(target))
    beat = None if interval is None else Beat(
        Op.PING, [sub.instance_id], interval, "KV event subscription ping", sub.url)
    thread = threading.Thread(
        target=_run, args=(weakref.ref(sub), client, target, stop, beat, sub.instance_id),
        daemon=True, name=f"lmcache-kv-fast-events-ping-{sub.instance_id:x}",
    )
    thread.start()
    return thread


def _run(ref: weakref.ref[Any], client: Any, target: Any, stop: threading.Event,
         beat: Beat | None, instance_id: int) -> None:
    closed_by_target = False
    ch = None
    try:
        while not stop.wait(_SLICE_S):
            if ref() is None:
                break
            if target_closed(target):
                closed_by_target = True
                break
            if beat is not None and beat.due():
                ch = ch or client.channel()
                beat.send(ch)
    except (KVCacheSDKError, zmq.ZMQError) as err:
        logger.debug("KV event ping thread stopped: %s", err)
    sub = ref() if closed_by_target else None
    if sub is not None:
        logger.info("KV event subscription %d: the context was closed; closing", instance_id)
        if sub.end_reason is None:
            sub.end_reason = "the SDK context was closed"
        sub.close()
