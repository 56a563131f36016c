"""Transports: the ZMQ control-plane client and the HTTP info client."""

from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall, ZmqClient

__all__ = ["Channel", "HttpInfoClient", "PendingCall", "ZmqClient"]
