"""Vocabulary shared by the KV-event modules: record kinds, medium, capability, timeouts.

The server's record type is :class:`~lmcache_kv_fast.protocol.types.KVEventRecord`
(docs/protocol.md §4.5); the stream, the store announcements and the vLLM mapper all speak it.
This module imports nothing of :mod:`lmcache_kv_fast.events`.
"""

from __future__ import annotations

#: Capability string of ``get_experimental`` when the server records KV events (docs/protocol.md §3.12).
KV_EVENT_CAPABILITY = "kv_event_stream"
#: ``seq`` of records produced by this SDK (server records start at 1).
LOCAL_SEQ = 0
#: Kinds of server records (docs/protocol.md §4.5).
KIND_STORED = "stored"
KIND_REMOVED = "removed"
#: The only medium the MP server reports.
MEDIUM_CPU = "CPU"

#: get_experimental and the first batch must arrive within this (capped by ctx.timeout).
PROBE_TIMEOUT_S = 5.0
