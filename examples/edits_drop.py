"""Selection by position: keep given indices, drop every k-th token, keep a ratio evenly.

Stores random KV for a few prompts (standing in for what vLLM cached), then rewrites every
prompt with ``batch.rewrite`` and each of ``edits.keep`` (explicit indices),
``edits.drop_every`` and ``edits.keep_ratio(..., "uniform")`` — each given the model's
RoPE (``rope_from_config``) so the kept keys are re-rotated to the positions the engine
gives a shortened prompt — reads every edit back under its kept tokens, checks it and
logs what it kept.

Run against a server you already have (``--config``: the model's ``config.json``)::

    python examples/edits_drop.py --url tcp://127.0.0.1:5555 \
        --http-url http://127.0.0.1:8080 --model meta-llama/Llama-3.2-1B --config /models/l1b

or let it start a local real server (Llama-3.2-1B's geometry and RoPE by default)::

    python examples/edits_drop.py --local
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the examples' helper

from _edit_example import EditFn, main, rewrite_and_check

from lmcache_kv_fast import edits


def build(ctx: Any, config: dict[str, Any], k: int = 10, ratio: float = 0.25
          ) -> dict[str, EditFn]:
    """The position-based edits, re-rotating with the config's RoPE."""
    rope = edits.rope_from_config(config)
    return {
        "keep(first 256 and 512..767)": edits.keep([*range(256), *range(512, 768)], rope=rope),
        f"drop_every({k})": edits.drop_every(k, rope=rope),
        f"keep_ratio({ratio}, 'uniform')": edits.keep_ratio(ratio, "uniform", rope=rope),
    }


def run(url: str, http_url: str, model: str, *, config: dict[str, Any] | None = None,
        prompts: int = 2, tokens: int = 2048) -> bool:
    """Seed, rewrite with each edit, read back and check. Returns success."""
    return rewrite_and_check(url, http_url, model, build, config=config, prompts=prompts,
                             tokens=tokens)


if __name__ == "__main__":
    sys.exit(main(None, __doc__, build))
