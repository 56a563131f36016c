"""SnapKV with given queries: keep what the observation window attends to, plus the window.

Stores random KV for a few prompts (standing in for what vLLM cached), rewrites every
prompt through ``batch.rewrite`` with ``edits.snapkv(queries, window, kernel, ratio=...,
rope=...)`` (Li et al. 2024): the queries of the prompt's last ``window`` tokens — random
but fixed here, as an engine would export them (post-RoPE, ``[L, window, Hq * head_dim]``)
— vote for the keys they attend to, pooled over ``kernel`` neighbours; the best tokens and
the window are kept and re-rotated with the model's RoPE. Reads the edit back, checks it
and logs what it kept.

Run against a server you already have (``--config``: the model's ``config.json``)::

    python examples/edits_snapkv.py --url tcp://127.0.0.1:5555 \
        --http-url http://127.0.0.1:8080 --model meta-llama/Llama-3.2-1B --config /models/l1b

or let it start a local real server (Llama-3.2-1B's geometry and RoPE by default)::

    python examples/edits_snapkv.py --local
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' helper

from _edit_example import EditFn, given_queries, main, rewrite_and_check

from lmcache_kv_fast import edits


def build(ctx: Any, config: dict[str, Any], window: int = 32, ratio: float = 0.3
          ) -> dict[str, EditFn]:
    """SnapKV over the given queries' window, with the config's RoPE."""
    rope = edits.rope_from_config(config)
    queries = given_queries(ctx, config, window)
    return {f"snapkv(queries, window={window}, kernel=7, ratio={ratio})":
            edits.snapkv(queries, window, 7, ratio=ratio, rope=rope)}


def run(url: str, http_url: str, model: str, *, config: dict[str, Any] | None = None,
        prompts: int = 2, tokens: int = 2048) -> bool:
    """Seed, rewrite, read back and check. Returns success."""
    return rewrite_and_check(url, http_url, model, build, config=config, prompts=prompts,
                             tokens=tokens)


if __name__ == "__main__":
    sys.exit(main(None, __doc__, build))
