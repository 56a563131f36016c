"""Write K/V into paged caches with the installed vLLM's own CPU kernel, per ISA.

Standalone script for the engine venv (never imports ``lmcache_kv_fast``). Usage::

    python kernel_probe.py CASES_JSON OUT_PATH

(the offline engine driver offers the same as its ``kernel_probe`` op, without a second
``import vllm``).

``CASES_JSON`` is a list of ``{"isa", "dtype", "num_kv_heads", "head_dim", "block_size",
"num_blocks", "seed"}``. For each case random K/V ``[T, NH, HS]`` (T = num_blocks *
block_size) go through ``torch.ops._C.cpu_attn_reshape_and_cache`` (what vLLM's CPU
attention backend calls to cache every token) into a zeroed
``[num_blocks, NH, BS, 2*HS]`` cache viewed and split exactly as
``vllm/v1/attention/backends/cpu_attn.py`` does. ``OUT_PATH`` gets a ``torch.save`` of
``{"machine": {...}, "cases": [{..., "k", "v", "cache"} or {..., "error"}]}``.

The writer is plain scalar code for every ISA, so it runs (and shows the ISA's order) on
machines that could not run that ISA's attention, e.g. the AMX order without AMX.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def probe(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every case; return ``{"machine": {...}, "cases": [...]}`` (see the module doc)."""
    import torch
    import vllm
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    machine = {
        "vllm": vllm.__version__,
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "avx512": bool(torch.cpu._is_avx512_supported()),
        "isa_bf16_bs128_hs64": cpu_attn._get_attn_isa(torch.bfloat16, 128, 64),
    }
    results = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        nh, hs, bs, nb = (int(case[k]) for k in ("num_kv_heads", "head_dim", "block_size",
                                                 "num_blocks"))
        gen = torch.Generator().manual_seed(int(case["seed"]))
        tokens = nb * bs
        k = torch.randn(tokens, nh, hs, generator=gen).to(dtype)
        v = torch.randn(tokens, nh, hs, generator=gen).to(dtype)
        cache = torch.zeros(nb, nh, bs, 2 * hs, dtype=dtype)
        key_cache, value_cache = cache.view(nb, nh, bs * 2, hs).chunk(2, dim=2)
        slots = torch.arange(tokens, dtype=torch.int64)
        try:
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, case["isa"])
        except Exception as err:
            results.append({**case, "error": f"{type(err).__name__}: {err}"})
            continue
        results.append({**case, "k": k, "v": v, "cache": cache})
    return {"machine": machine, "cases": results}


def main() -> None:
    """Run the cases named on the command line and save the results."""
    import torch

    torch.save(probe(json.loads(sys.argv[1])), sys.argv[2])


if __name__ == "__main__":
    main()
