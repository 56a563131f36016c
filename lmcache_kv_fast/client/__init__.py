"""What a connected context does, one module per concern.

* ``session.py``: the state every flow shares, the per-operation guard, per-key
  serialisation, registration checks, close.
* ``handshake.py``: connecting (``/config``, ``/version``, ``noop``, ``/status``,
  registration).
* ``liveness.py``: the background thread (heartbeat pings, release acknowledgements).
* ``lookup.py``, ``retrieve.py``, ``store.py``: the operations' wire flows.
* ``read_hints.py``: the retrieve's speculative gather from where a prefix lay last time.

The public face is :class:`lmcache_kv_fast.context.LMCacheKVCacheContext`.
"""
