"""KVLayout.from_hf_config / load_hf_config and resolve_engine_layout (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmcache_kv_fast import KVCacheSDKError, KVLayout
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError
from lmcache_kv_fast.layout import (
    CpuEngineKV,
    EngineLayoutUnresolvedError,
    ModelConfigNotFoundError,
    UnsupportedEngineLayoutError,
    load_hf_config,
    resolve_engine_layout,
)

LLAMA = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "hidden_size": 256, "dtype": "bfloat16"}


def write_model(root: Path, cfg: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


# ---------------------------------------------------------------------- from_hf_config
def test_from_hf_config_dict_dir_and_file(tmp_path):
    want = KVLayout(2, 2, 64, torch.bfloat16, 128)
    assert KVLayout.from_hf_config(LLAMA, block_size=128) == want
    d = write_model(tmp_path / "m", LLAMA)
    assert KVLayout.from_hf_config(d, block_size=128) == want
    assert KVLayout.from_hf_config(str(d / "config.json"), block_size=128) == want


def test_from_hf_config_defaults_and_overrides():
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 512,
           "torch_dtype": "float16"}  # transformers 4 style; no kv heads, no head_dim
    assert KVLayout.from_hf_config(cfg) == KVLayout(3, 8, 64, torch.float16, 16)
    assert KVLayout.from_hf_config(cfg, dtype="float32").dtype == torch.float32
    nested = {"model_type": "llava", "text_config": {**LLAMA}, "dtype": "bfloat16"}
    assert KVLayout.from_hf_config(nested).num_kv_heads == 2


def test_from_hf_config_mla_and_hybrid():
    mla = {"num_hidden_layers": 4, "num_attention_heads": 16, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "dtype": "bfloat16"}
    assert KVLayout.from_hf_config(mla) == KVLayout(4, 1, 576, torch.bfloat16, mla=True)
    hybrid = {**LLAMA, "layer_types": ["full_attention", "linear_attention"]}
    with pytest.raises(KVCacheSDKError, match="hybrid"):
        KVLayout.from_hf_config(hybrid)
    sliding = {**LLAMA, "layer_types": ["full_attention", "sliding_attention"]}
    assert KVLayout.from_hf_config(sliding).num_layers == 2


@pytest.mark.parametrize(("cfg", "match"), [
    ({**LLAMA, "num_hidden_layers": 0}, "num_hidden_layers must be a positive int"),
    ({k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({k: v for k, v in LLAMA.items() if k != "dtype"}, "pass dtype="),
    ({**LLAMA, "head_dim": None, "hidden_size": 250}, "not a multiple"),
    ({**LLAMA, "num_key_value_heads": "2"}, "num_key_value_heads"),
])
def test_from_hf_config_bad_fields(cfg, match):
    with pytest.raises(KVCacheSDKError, match=match):
        KVLayout.from_hf_config(cfg)


def test_from_hf_config_bad_arguments(tmp_path):
    with pytest.raises(InvalidTypeError):
        KVLayout.from_hf_config(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        KVLayout.from_hf_config(LLAMA, dtype="complex64")
    with pytest.raises(InvalidArgumentError):
        KVLayout.from_hf_config(LLAMA, block_size=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(KVCacheSDKError, match="JSON object"):
        KVLayout.from_hf_config(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(KVCacheSDKError, match="cannot read"):
        KVLayout.from_hf_config(bad)


def test_hub_cache_lookup(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny" / "snapshots" / "abc123"
    write_model(snap, LLAMA)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert load_hf_config("org/tiny")["num_hidden_layers"] == 2
    write_model(hub / "models--org--other" / "snapshots" / "x", {**LLAMA, "num_hidden_layers": 7})
    assert load_hf_config("org/other")["num_hidden_layers"] == 7  # no refs/main: the snapshot
    with pytest.raises(ModelConfigNotFoundError, match="model_config="):
        load_hf_config("org/missing")
    with pytest.raises(ModelConfigNotFoundError, match=str(hub)):
        load_hf_config(str(tmp_path / "nowhere"))


# ---------------------------------------------------------------------- resolver
def status(**entries) -> dict:
    return {"cache_context_meta": {}, "non_cuda_context_meta": {
        iid: {"model_name": m, "world_size": ws, "block_size": bs, "use_mla": mla}
        for iid, (m, ws, bs, mla) in entries.items()}}


def test_resolve_cpu_engine(tmp_path):
    d = str(write_model(tmp_path / "m", LLAMA))
    st = status(e1=(d, 1, 128, True), other=("x", 1, 16, False))
    res = resolve_engine_layout(st, d, amx=False)
    assert res.cpu == CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "vec")
    assert res.layout == KVLayout(2, 1, 256, torch.bfloat16, 128, mla=True)
    assert res.token_layout == KVLayout(2, 2, 64, torch.bfloat16, 128)
    assert res.instance_ids == ("e1",) and res.world_size == 1
    assert "kernel vec" in res.describe()
    assert resolve_engine_layout(st, d, amx=True).cpu.kernel == "amx"
    assert resolve_engine_layout(st, d, kernel="vec16").cpu.kernel == "vec16"


def test_resolve_same_geometry_sdk_entries_are_harmless(tmp_path):
    d = str(write_model(tmp_path / "m", LLAMA))
    st = status(e1=(d, 1, 128, True), sdk=(d, 1, 128, True))
    assert resolve_engine_layout(st, d, amx=False).instance_ids == ("e1", "sdk")


def test_resolve_disagreeing_entries(tmp_path):
    d = str(write_model(tmp_path / "m", LLAMA))
    st = status(e1=(d, 1, 128, True), sdk=(d, 1, 16, False))
    with pytest.raises(EngineLayoutUnresolvedError, match="block_size=") as err:
        resolve_engine_layout(st, d)
    assert "e1" in str(err.value) and "sdk" in str(err.value)
    assert resolve_engine_layout(st, d, block_size=128, amx=False).instance_ids == ("e1",)
    assert resolve_engine_layout(st, d, exclude_instance_ids=["sdk"], amx=False).cpu
    two = resolve_engine_layout(st, d, block_size=16)
    assert two.cpu is None and two.layout == KVLayout(2, 2, 64, torch.bfloat16, 16)


def test_resolve_without_registration(tmp_path):
    d = str(write_model(tmp_path / "m", LLAMA))
    with pytest.raises(EngineLayoutUnresolvedError, match="pass block_size="):
        resolve_engine_layout(status(), d)
    res = resolve_engine_layout(status(), "served-name", block_size=128, model_config=d, amx=False)
    assert res.cpu is not None and res.instance_ids == ()
    with pytest.raises(ModelConfigNotFoundError, match="model_config="):
        resolve_engine_layout(status(x=("served-name", 1, 128, True)), "served-name")


def test_resolve_hints_other_spelling(tmp_path, monkeypatch):
    d = write_model(tmp_path / "m", LLAMA)
    monkeypatch.chdir(tmp_path)
    st = status(e1=(str(d), 1, 128, True))
    with pytest.raises(EngineLayoutUnresolvedError, match="another spelling"):
        resolve_engine_layout(st, "m")


def test_resolve_refusals(tmp_path):
    d = str(write_model(tmp_path / "m", LLAMA))
    with pytest.raises(KVCacheSDKError, match="world_size 1"):
        resolve_engine_layout(status(e=(d, 2, 128, True)), d)
    mla = str(write_model(tmp_path / "mla", {"num_hidden_layers": 2, "num_attention_heads": 4,
                                              "kv_lora_rank": 64, "dtype": "bfloat16"}))
    with pytest.raises(KVCacheSDKError, match="MLA"):
        resolve_engine_layout(status(e=(mla, 1, 128, True)), mla)
    with pytest.raises(UnsupportedEngineLayoutError):
        resolve_engine_layout(status(e=(d, 1, 128, True)), d, kernel="neon")
    with pytest.raises(KVCacheSDKError, match="block_size"):
        resolve_engine_layout(status(e=(d, 1, "x", True)), d)
