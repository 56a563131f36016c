"""KV-cache edits: token selection and RoPE position repair for the per-token KV.

Every selection is an edit function ``fn(kv, tokens) -> (kv, tokens)`` — the shape
``batch.rewrite``, ``store_many`` pipelines and a batched stream's ``modify`` take — for
the per-token KV ``[2, L, T, D]``. It keeps one token set per sequence in token order and,
given ``rope=`` (:func:`rope_from_config`), re-rotates the kept keys to positions
``0 .. T'-1``: the engine puts the next token at ``T'``, while a kept key still carries
the rotation of its old position. See ``docs/edits.md``.
"""

from lmcache_kv_fast.edits._base import Selection, chain
from lmcache_kv_fast.edits._config import rope_from_config
from lmcache_kv_fast.edits._methods import keep_budget, keep_ratio, key_norm, rkv, snapkv
from lmcache_kv_fast.edits._plan import RowPlan, plannable, row_plan
from lmcache_kv_fast.edits._positional import drop_every, keep, streaming_llm
from lmcache_kv_fast.edits._rerotate import rerotate
from lmcache_kv_fast.edits._rope import ROPE_TYPES, RoPE
from lmcache_kv_fast.edits._scores import AGGREGATES

__all__ = [
    "AGGREGATES",
    "ROPE_TYPES",
    "RoPE",
    "RowPlan",
    "Selection",
    "chain",
    "drop_every",
    "keep",
    "keep_budget",
    "keep_ratio",
    "key_norm",
    "plannable",
    "rerotate",
    "rkv",
    "rope_from_config",
    "row_plan",
    "snapkv",
    "streaming_llm",
]
