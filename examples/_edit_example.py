"""What the ``edits_*.py`` examples share: the model config, seeding, rewriting, checking.

Each example builds its edits (``lmcache_kv_fast.edits``, with ``rope=`` read from a
``config.json``) and calls :func:`rewrite_and_check`: random KV stands in for what vLLM
cached for a few prompts; ``batch.rewrite`` applies each edit to every prompt (retrieve,
edit, store under the kept tokens); the edited KV is read back under the kept tokens and
compared with the same edit applied here; what each edit kept is logged as position
ranges. :func:`main` is the command line (``--local`` starts a real server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import batch, edits

logger = logging.getLogger("edit_example")

#: Llama-3.2-1B's ``config.json`` (the parts the examples read): its RoPE and KV geometry.
LLAMA32_1B_CONFIG: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 2048, "head_dim": 64, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 16, "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}

EditFn = Callable[[Any, Sequence[int]], tuple[torch.Tensor, Sequence[int]]]
#: ``build(ctx, config) -> {name: edit}``: an example's edits for a connected context.
BuildEdits = Callable[[Any, dict[str, Any]], dict[str, EditFn]]


def load_config(path: str | None) -> dict[str, Any]:
    """A model's ``config.json`` (a file or a model directory), else Llama-3.2-1B's."""
    if path is None:
        return dict(LLAMA32_1B_CONFIG)
    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())


def given_queries(ctx: Any, config: dict[str, Any], count: int, seed: int = 1) -> torch.Tensor:
    """Random but fixed query tensors ``[L, count, Hq * head_dim]`` (what an engine exports)."""
    layers = ctx.kv_shape(1)[1]
    width = int(config["num_attention_heads"]) * int(config.get("head_dim") or
                                                       config["hidden_size"] //
                                                       config["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, count, width, generator=gen).to(ctx.dtype)


def ranges(idx: Sequence[int], limit: int = 6) -> str:
    """Positions as ranges, ``"0-3, 1028-2047"`` (the first ``limit``, a count, the last)."""
    out: list[str] = []
    start = prev = None
    for i in [*idx, None]:
        if start is not None and (i is None or i != prev + 1):
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    if len(out) > limit + 1:
        out = [*out[:limit], f"... ({len(out) - limit - 1} more ranges) ...", out[-1]]
    return ", ".join(out)


def _check(ctx: Any, name: str, kv: torch.Tensor, prompt: list[int], edit: EditFn,
           back: torch.Tensor | None) -> bool:
    """Compare one read-back edit with the edit applied here; log what it kept."""
    want_kv, want_toks = edit(kv, prompt)
    pos = {t: i for i, t in enumerate(prompt)}
    kept = [pos[t] for t in want_toks]
    whole = len(kept) // ctx.chunk_size * ctx.chunk_size
    same = back is not None and back.shape[-2] == whole and torch.equal(
        back, want_kv.narrow(-2, 0, whole))
    logger.info("%s: kept %d of %d tokens: %s; read back %s (%d whole-chunk tokens)", name,
                len(kept), len(prompt), ranges(kept), "EXACTLY" if same else "WRONG", whole)
    return same


def rewrite_and_check(url: str, http_url: str, model: str, build: BuildEdits, *,
                      config: dict[str, Any] | None = None, prompts: int = 2,
                      tokens: int = 2048, seed: int = 0) -> bool:
    """Seed ``prompts`` prompts, rewrite them with each edit of ``build``, check them all.

    Returns:
        True when every edit of every prompt was stored and read back as computed here.
    """
    config = dict(LLAMA32_1B_CONFIG) if config is None else config
    rng = random.Random(seed)
    token_lists = [rng.sample(range(100_000), tokens) for _ in range(prompts)]
    gen = torch.Generator().manual_seed(seed)
    with lmc_sdk.connect(url, http_url, model, timeout=30) as ctx:
        kvs = [torch.randn(ctx.kv_shape(tokens), generator=gen).to(ctx.dtype)
               for _ in range(prompts)]
        rep = batch.store_many(ctx, zip(kvs, token_lists), progress=False)
        if rep.ok != prompts:
            logger.error("seeding failed: %s", rep.errors[:3])
            return False
        ok = True
        for name, edit in build(ctx, config).items():
            rep = batch.rewrite(ctx, token_lists, edit, progress=False)
            if rep.ok != prompts:
                logger.error("%s: rewrite failed: %s", name, rep.errors[:3])
                return False
            logger.info("%s: batch.rewrite of %d prompts in %.3f s", name, prompts,
                        rep.seconds)
            wanted = [edit(kv, p)[1] for kv, p in zip(kvs, token_lists)]
            for j, back in batch.retrieve_many(ctx, [list(t) for t in wanted]):
                ok &= _check(ctx, f"{name} (prompt {j})", kvs[j], token_lists[j], edit, back)
        return ok


def main(argv: list[str] | None, doc: str, build: BuildEdits) -> int:
    """The examples' command line: a server (given, or ``--local``), a config, sizes."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--http-url")
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--config", help="the model's config.json or directory (default: "
                                     "Llama-3.2-1B's RoPE and geometry)")
    ap.add_argument("--local", action="store_true", help="start a local real server")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config)
    with contextlib.ExitStack() as stack:
        if args.local or not args.url:
            from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

            srv = stack.enter_context(LMCacheServer(shm=True, l1_size_gb=2))
            rope = edits.rope_from_config(config)
            register_vllm_layout(srv.url, args.model, num_layers=config["num_hidden_layers"],
                                 num_kv_heads=config["num_key_value_heads"],
                                 head_size=rope.head_dim)
            url, http_url = srv.url, srv.http_url
        else:
            url, http_url = args.url, args.http_url
        return 0 if rewrite_and_check(url, http_url, args.model, build, config=config,
                                      prompts=args.prompts, tokens=args.tokens) else 1
