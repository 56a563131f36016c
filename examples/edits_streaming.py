"""StreamingLLM: keep the attention sinks and a recent window, positions re-assigned.

Stores random KV for a few prompts (standing in for what vLLM cached), rewrites every
prompt with ``edits.streaming_llm(sinks, window, rope=...)`` through ``batch.rewrite``
(Xiao et al. 2023 give the kept tokens positions within the cache: the first ``sinks``
tokens and the last ``window`` become ``0 .. sinks + window - 1``, which is what
``rope=`` does to the keys), reads the edit back, checks it and logs what it kept.

Run against a server you already have (``--config``: the model's ``config.json``)::

    python examples/edits_streaming.py --url tcp://127.0.0.1:5555 \
        --http-url http://127.0.0.1:8080 --model meta-llama/Llama-3.2-1B --config /models/l1b

or let it start a local real server (Llama-3.2-1B's geometry and RoPE by default)::

    python examples/edits_streaming.py --local
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' helper

from _edit_example import EditFn, main, rewrite_and_check

from lmcache_kv_fast import edits


def build(ctx: Any, config: dict[str, Any], sinks: int = 4, window: int = 508
          ) -> dict[str, EditFn]:
    """StreamingLLM with the config's RoPE: ``sinks`` first tokens and ``window`` last."""
    rope = edits.rope_from_config(config)
    return {f"streaming_llm({sinks}, {window})": edits.streaming_llm(sinks, window, rope=rope)}


def run(url: str, http_url: str, model: str, *, config: dict[str, Any] | None = None,
        prompts: int = 2, tokens: int = 2048) -> bool:
    """Seed, rewrite, read back and check. Returns success."""
    return rewrite_and_check(url, http_url, model, build, config=config, prompts=prompts,
                             tokens=tokens)


if __name__ == "__main__":
    sys.exit(main(None, __doc__, build))
