"""Workload sizes and repetitions (``--quick`` and the size flags fill them), L1 sizing.

Standard library only: the worker interpreters import this module too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
#: The benchmark models: 8 KV heads x 128 = hidden 1024, bf16.
KV_HEADS, HEAD_SIZE, HIDDEN, ITEMSIZE = 8, 128, 1024, 2
#: Never ask for more L1 SHM than this (``/dev/shm`` is shared with other users).
SHM_CAP_GIB = 13.0
SHM_POOL_PREFIX = "lmcache_l1_pool_"


def kv_nbytes(layers: int, tokens: int) -> int:
    """Bytes of a ``[2, layers, tokens, 1024]`` bf16 KV tensor."""
    return 2 * layers * tokens * HIDDEN * ITEMSIZE


@dataclass
class Sizes:
    """Workload sizes and repetitions (``--quick`` and the size flags fill it).

    W3P and W3F run on W3's fields (``w3_*``).

    The defaults are the issue's sizes, the ones the targets are defined on
    (:func:`~.targets.reduced_sizes`). A new workload adds its fields here (and its
    ``--quick`` values to :data:`QUICK`).
    """

    chunk: int = 256
    w1_layers: int = 32
    w1_tokens: int = 4096
    w2_layers: int = 28
    w2_ops: int = 200
    w2_warmup: int = 10
    w3_sequences: int = 16
    w3_tokens: int = 2048
    w3_k: int = 10
    w3_reps: int = 2
    w3_warmup: int = 1
    w7_sequences: int = 16
    w7_tokens: int = 2048
    w7_layers: int = 16
    w7_kv_heads: int = 8
    w7_head_dim: int = 64
    w7_window: int = 32
    w7_ratio: float = 0.5
    w7_reps: int = 2
    w7_warmup: int = 1
    w4_tokens: int = 512
    w4_reps: int = 15
    reps: int = 7
    warmup: int = 2
    ic_reps: int = 5
    ic_warmup: int = 1

    @property
    def w1_bytes(self) -> int:
        """Bytes of the W1 tensor."""
        return kv_nbytes(self.w1_layers, self.w1_tokens)

    @property
    def w2_bytes(self) -> int:
        """Bytes of the W2 chunk."""
        return kv_nbytes(self.w2_layers, self.chunk)

    @property
    def w3_seq_bytes(self) -> int:
        """Bytes of one W3 sequence (it uses the W1 model)."""
        return kv_nbytes(self.w1_layers, self.w3_tokens)

    @property
    def w3_edit_tokens(self) -> int:
        """Whole-chunk tokens of one edited W3 sequence."""
        kept = self.w3_tokens - self.w3_tokens // self.w3_k
        return kept // self.chunk * self.chunk

    @property
    def w3_moved_bytes(self) -> int:
        """KV bytes one W3 rewrite moves (every retrieve plus every store)."""
        return self.w3_sequences * (self.w3_seq_bytes + kv_nbytes(self.w1_layers,
                                                                   self.w3_edit_tokens))

    @property
    def w3_input_bytes(self) -> int:
        """KV bytes a W3 rewrite reads: every seeded sequence (W3F's memcpy copies these)."""
        return self.w3_sequences * self.w3_seq_bytes

    @property
    def w3_resident_bytes(self) -> int:
        """L1 bytes a W3 contender keeps: the seeded sequences and their edits."""
        return self.w3_moved_bytes

    @property
    def w7_seq_bytes(self) -> int:
        """Bytes of one W7 sequence (Llama-3.2-1B's geometry, bf16)."""
        return 2 * self.w7_layers * self.w7_tokens * self.w7_kv_heads * self.w7_head_dim * \
            ITEMSIZE

    @property
    def w7_moved_bytes(self) -> int:
        """KV bytes one W7 rewrite moves: every retrieve plus every (kept, whole-chunk) store."""
        kept = math.ceil(self.w7_ratio * self.w7_tokens) // self.chunk * self.chunk
        return self.w7_sequences * (self.w7_seq_bytes +
                                    self.w7_seq_bytes * kept // self.w7_tokens)

    @property
    def w4_bytes(self) -> int:
        """Bytes of the W4 tensor (W1 model)."""
        return kv_nbytes(self.w1_layers, self.w4_tokens)


QUICK = {"w1_tokens": 1024, "w2_ops": 20, "w2_warmup": 2, "w3_sequences": 3, "w3_tokens": 512,
         "w3_reps": 1, "w3_warmup": 1, "w4_tokens": 256, "w4_reps": 5, "reps": 3, "warmup": 1,
         "ic_reps": 1, "ic_warmup": 0, "w7_sequences": 3, "w7_tokens": 512, "w7_reps": 1}


def shm_l1_gib(s: Sizes, workloads: Sequence[str]) -> float:
    """L1 (GiB) of the SHM server: >= 6x the largest request, W3's working set under 75 %."""
    need = 6 * max(s.w1_bytes, s.w2_bytes)
    if any(w in workloads for w in ("W3", "W3P", "W3F")):
        need = max(need, int(s.w3_resident_bytes / 0.75) + s.w3_seq_bytes)
    if "W7" in workloads:
        need = max(need, int(s.w7_moved_bytes / 0.75) + s.w7_seq_bytes)
    return max(1.0, math.ceil(need / GiB * 2) / 2)


def pickle_l1_gib(s: Sizes) -> float:
    """L1 (GiB) of the pickle server (it allocates all of it at start: keep it small)."""
    return max(0.5, math.ceil(6 * max(s.w2_bytes, s.w4_bytes) / GiB * 4) / 4)
