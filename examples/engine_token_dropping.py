"""Token dropping with a real vLLM engine: the engine writes the KV, the SDK edits it, the
engine decodes from the edit.

1. A local real LMCache server and a real vLLM engine (CPU, ``LMCacheMPConnector``) on a
   tiny random-weight Llama start (the engine lives in ``.venv-engine``, see
   ``scripts/engine-venv.sh``).
2. The engine prefills a few prompts; its connector stores their KV in LMCache.
3. The SDK connects with nothing but the model name: it finds the CPU engine's geometry
   from the engine's registration and the model's ``config.json``.
4. Per prompt: retrieve the per-token K/V ``[2, L, T, kv_heads*head_size]``, drop every
   10th token (K/V and id) with ``edits.drop_every(10, rope=...)``, which re-rotates the
   kept keys to their new positions (the model's RoPE from its ``config.json``), store the
   edit under the edited token list (whole chunks).
5. The engine decodes the edited prompts: it loads the edited prefix from LMCache (an
   external prefix hit of whole chunks) and computes only the rest.

It prints the external prefix hits and the time of each phase::

    python examples/engine_token_dropping.py [--prompts 4] [--tokens 800] [-k 10]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import time
from collections.abc import Iterator

import lmcache_kv_fast as lkf
from lmcache_kv_fast import edits
from lmcache_kv_fast.testing import LMCacheServer
from testbed.engine import OfflineEngine, engine_lmcache_server
from testbed.tiny_model import ensure_tiny_model

logger = logging.getLogger("engine_token_dropping")

BLOCK_SIZE = 128  # vLLM block size
CHUNK_SIZE = 256  # LMCache chunk size (a multiple of the block size)


class Phases:
    """Wall time of each named phase, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def external_hits(metrics: dict[str, float]) -> float:
    """vLLM's counter of prompt tokens served from LMCache (external prefix cache hits)."""
    return max((v for k, v in metrics.items() if "external_prefix_cache_hits" in k), default=0.0)


def run(*, prompts: int = 4, tokens: int = 800, k: int = 10, decode_tokens: int = 8,
        seed: int = 0, server: LMCacheServer | None = None,
        engine: OfflineEngine | None = None) -> bool:
    """Run the whole workflow once; True when every edited prompt hit its stored chunks.

    ``server`` / ``engine``: a running LMCache server and an engine on the tiny model
    (the tests share theirs); by default both are started here and stopped at the end.
    """
    rng = random.Random(seed)
    # Token ids of the tiny vocabulary (3..1023: no special tokens).
    batch = [[rng.randrange(3, 1024) for _ in range(tokens)] for _ in range(prompts)]
    phase = Phases()
    with contextlib.ExitStack() as stack:
        with phase("model"):
            model = ensure_tiny_model()  # vLLM registers the model by this path
        if server is None or engine is None:
            with phase("start LMCache server"):
                # LMCACHE_KV_FAST_TEST_SERVER=0.5.7rc2: that server and its connector
                server = stack.enter_context(engine_lmcache_server(chunk_size=CHUNK_SIZE,
                                                                   l1_size_gb=0.5))
            with phase("start vLLM engine"):
                engine = stack.enter_context(OfflineEngine(model, server.port,
                                                           block_size=BLOCK_SIZE))

        # 2. The engine prefills: its connector stores every whole chunk of KV.
        with phase("engine prefill"):
            gens = engine.generate(batch, max_tokens=1)
        logger.info("engine prefilled %d prompts x %d tokens (cached before: %s)", prompts,
                    tokens, [g.num_cached_tokens for g in gens])

        # 3. Connect with just the model name: the geometry is found, not given.
        with phase("SDK connect"):
            ctx = stack.enter_context(lkf.connect(server.url, server.http_url, str(model)))
        assert ctx.engine_kv is not None, "expected a CPU engine"
        logger.info("connected: %s; per-token KV of T tokens: %s", ctx.engine_kv.describe(),
                    list(ctx.kv_shape(tokens)))

        # 4. Retrieve per-token K/V, drop every k-th token, store under the edited ids.
        # Drop every k-th token and re-rotate the kept keys to their new positions: the
        # engine puts the next token at the edited length (docs/edits.md).
        edit = edits.drop_every(k, rope=edits.rope_from_config(model))
        edited: list[list[int]] = []
        expected: list[int] = []
        for prompt in batch:
            with phase("SDK retrieve"):
                kv = ctx.retrieve(prompt)  # [2, L, hit, NH*HS], hit = whole chunks
            if kv is None:
                logger.error("nothing cached for a prefilled prompt")
                return False
            hit = kv.shape[-2]
            with phase("SDK edit"):
                new_kv, new_prefix = edit(kv, prompt[:hit])
            with phase("SDK store"):
                res = ctx.store_ex(new_kv, new_prefix)  # whole chunks of the edit
            if not res.ok:
                logger.error("store of the edit failed: %s", res)
                return False
            # The decode prompt: the edited prefix, then the rest of the edited prompt.
            new_prompt = new_prefix + [t for i, t in enumerate(prompt) if i >= hit
                                       and (i + 1) % k]
            edited.append(new_prompt)
            expected.append(res.tokens_stored)
            logger.info("prompt: %d tokens cached -> per-token %s; kept %d; stored %d "
                        "tokens (%d chunks)", hit, list(kv.shape), len(new_prefix),
                        res.tokens_stored, res.chunks_total)

        # 5. The engine decodes the edited prompts from the edited cache.
        engine.reset_prefix_cache()  # hits can now only come from LMCache
        before = external_hits(engine.metrics())
        with phase("engine decode"):
            outs = engine.generate(edited, max_tokens=decode_tokens)
        hits = [g.num_cached_tokens for g in outs]
        counted = external_hits(engine.metrics()) - before
        logger.info("engine decode: external prefix hits per prompt %s (expected %s; vLLM's "
                    "external_prefix_cache_hits counter +%d)", hits, expected, counted)
        for g in outs:
            logger.info("  decoded %s", g.token_ids)
        with phase("stop"):
            stack.close()
    logger.info("time of each phase:")
    for name, sec in phase.seconds.items():
        logger.info("  %-22s %8.3f s", name, sec)
    ok = hits == expected and counted == sum(expected)
    logger.info("token dropping through the engine: %s", "OK" if ok else "UNEXPECTED HITS")
    return ok


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=800, help="prompt length (<= 2000)")
    ap.add_argument("-k", type=int, default=10, help="drop every k-th token")
    ap.add_argument("--decode-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("lmcache_kv_fast", "lmcache_kv_fast.testing"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return 0 if run(prompts=args.prompts, tokens=args.tokens, k=args.k,
                    decode_tokens=args.decode_tokens) else 1


if __name__ == "__main__":
    sys.exit(main())
