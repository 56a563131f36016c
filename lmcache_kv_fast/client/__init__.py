"""What a connected context does, one module per concern.

* ``session.py``: the state every flow shares, the per-operation guard, per-key
  serialisation, registration checks, close.
* ``handshake.py``: connecting (``/config``, ``/version``, ``noop``, ``/status``,
  registration).
* ``liveness.py``: the background thread (heartbeat pings, writer refresh, release
  acknowledgements, late replies).
* ``late.py``: what a timed-out operation still owes the server, settled as its late
  replies arrive (on the retired channel, by the background thread and ``close()``).
* ``lookup.py``, ``retrieve.py``, ``store.py``: the operations' wire flows.
* ``read_hints.py``: the retrieve's speculative gather from where a prefix lay last time.

The public face is :class:`lmcache_kv_fast.client.context.LMCacheKVCacheContext`.
"""
