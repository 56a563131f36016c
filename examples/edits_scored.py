"""Score-based selection: KeyDiff, L2 norm (no queries) and R-KV (importance - redundancy).

Stores random KV for a few prompts (standing in for what vLLM cached), rewrites every
prompt through ``batch.rewrite`` with ``edits.key_norm(ratio, method="keydiff")`` (keys
least like their head's mean key; Park et al. 2025), ``method="l2"`` (lowest-norm keys;
Devoto et al. 2024) and ``edits.rkv(queries, ...)`` (window attention minus key
redundancy; Cai et al. 2025; the queries random but fixed, as an engine would export
them), each with the model's RoPE; reads the edits back, checks them and logs what each
kept.

Run against a server you already have (``--config``: the model's ``config.json``)::

    python examples/edits_scored.py --url tcp://127.0.0.1:5555 \
        --http-url http://127.0.0.1:8080 --model meta-llama/Llama-3.2-1B --config /models/l1b

or let it start a local real server (Llama-3.2-1B's geometry and RoPE by default)::

    python examples/edits_scored.py --local
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' helper

from _edit_example import EditFn, given_queries, main, rewrite_and_check

from lmcache_kv_fast import edits


def build(ctx: Any, config: dict[str, Any], ratio: float = 0.5) -> dict[str, EditFn]:
    """KeyDiff, L2 and R-KV keeping ``ratio`` of the tokens, with the config's RoPE."""
    rope = edits.rope_from_config(config)
    queries = given_queries(ctx, config, 8)
    return {
        f"key_norm({ratio}, keydiff, sinks=4)": edits.key_norm(ratio, sinks=4, rope=rope),
        f"key_norm({ratio}, l2, sinks=4)": edits.key_norm(ratio, method="l2", sinks=4,
                                                           rope=rope),
        f"rkv(queries, window=8, ratio={ratio})": edits.rkv(queries, 8, 7, ratio=ratio,
                                                            rope=rope),
    }


def run(url: str, http_url: str, model: str, *, config: dict[str, Any] | None = None,
        prompts: int = 2, tokens: int = 2048) -> bool:
    """Seed, rewrite with each edit, read back and check. Returns success."""
    return rewrite_and_check(url, http_url, model, build, config=config, prompts=prompts,
                             tokens=tokens)


if __name__ == "__main__":
    sys.exit(main(None, __doc__, build))
