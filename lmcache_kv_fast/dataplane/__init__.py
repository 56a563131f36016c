"""Data planes: the mapped SHM pool and the pickle plane (with a restricted unpickler)."""

from lmcache_kv_fast.dataplane.pickle_plane import dumps_chunks, safe_loads_chunks
from lmcache_kv_fast.dataplane.shm import ShmPlane, check_slots_match

__all__ = ["ShmPlane", "check_slots_match", "dumps_chunks", "safe_loads_chunks"]
