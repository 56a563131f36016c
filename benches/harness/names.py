"""Names of the paths (the table's rows) and of the ops (its workload column).

Standard library only: the worker interpreters import this module too (see
:mod:`.worker`).
"""

from __future__ import annotations

__all__ = [
    "IC_KVF", "IC_TORCH", "IC_UP", "KVF_PICKLE", "KVF_T1", "KVF_TORCH", "UPSTREAM",
    "UPSTREAM_PICKLE", "UPSTREAM_T1", "W1_COPY_COLD", "W1_COPY_COLD_SHM", "W1_COPY_WARM",
    "W1_RET_COLD", "W1_RET_OUT", "W1_RET_WARM", "W1_STORE_COLD", "W1_STORE_WARM", "W2_COPY",
    "W2_RET", "W2_STORE", "W3", "W3F", "W3F_COPY", "W3F_DROP", "W3F_PLAIN", "W3F_ROPE", "W3P",
    "W3P_BATCH", "W3P_SEQ", "W3_BATCH", "W3_SEQ", "W4_COPY",
    "W4_RET", "W4_STORE", "W7", "W7_BATCH", "W7_EDIT", "W7_LOOP", "W7_RET",
    "kvf_native", "roofline",
]

# ---------------------------------------------------------------------------- paths
UPSTREAM, UPSTREAM_T1, UPSTREAM_PICKLE = "upstream", "upstream@torch1", "upstream-pickle"
KVF_TORCH, KVF_PICKLE, KVF_T1 = "kvfast-torch", "kvfast-pickle", "kvfast-native@torch1"


def kvf_native(threads: int) -> str:
    """Path name of this SDK's native backend at ``threads`` copy threads."""
    return f"kvfast-native-{threads}t"


def roofline(threads: int) -> str:
    """Path name of the memcpy roofline at ``threads`` threads."""
    return f"roofline-{threads}t"


# ---------------------------------------------------------------------------- ops
W1_STORE_WARM, W1_STORE_COLD = "W1 store warm", "W1 store cold"
W1_RET_WARM, W1_RET_COLD, W1_RET_OUT = "W1 retrieve warm", "W1 retrieve cold", "W1 retrieve+out warm"
W1_COPY_WARM, W1_COPY_COLD = "W1 copy warm", "W1 copy cold"
W1_COPY_COLD_SHM = "W1 copy cold shm"
W2_STORE, W2_RET, W2_COPY = "W2 store", "W2 retrieve", "W2 copy"
#: W3 is driven as one op ("W3") whose reps time both contenders, recorded under these.
W3, W3_SEQ, W3_BATCH = "W3", "W3 rewrite sequential", "W3 rewrite batch"
#: W3P: W3 with the issue's plain edit (``kv.index_select(2, torch.tensor(keep))``, no
#: ``alloc``) for every contender, driven as one op ("W3P") like W3.
W3P, W3P_SEQ, W3P_BATCH = "W3P", "W3P loop (plain fn)", "W3P batch (plain fn)"
#: W3F: ``batch.rewrite`` with W3P's plain fn (the tensor path) vs the library's
#: ``edits.drop_every`` (the fused path: rows slot to slot in the core), with and without a
#: llama3 re-rotation, and a flat memcpy of the batch's input bytes (one sequence's bytes
#: copied once per sequence, the copies' times summed), driven as one op.
W3F, W3F_PLAIN = "W3F", "W3F batch (plain fn)"
W3F_DROP, W3F_ROPE = "W3F batch (fused drop)", "W3F batch (fused drop+llama3)"
W3F_COPY = "W3F memcpy (1 seq x N, summed)"
W4_STORE, W4_RET, W4_COPY = "W4 store", "W4 retrieve", "W4 copy"
#: W7: rewrite with SnapKV + re-rotation at Llama-3.2-1B's geometry, driven as one op:
#: ``batch.rewrite`` with the library edit vs upstream's loop with the edit in plain torch,
#: and (this SDK) one sequence's retrieve and the library edit's own time.
W7, W7_LOOP, W7_BATCH = "W7", "W7 loop (plain-torch SnapKV+rope)", "W7 batch (edits.snapkv+rope)"
W7_RET, W7_EDIT = "W7 retrieve (1 sequence)", "W7 edit (1 sequence)"
IC_TORCH, IC_KVF, IC_UP = "import torch", "kvfast import+connect", "upstream import+connect"
