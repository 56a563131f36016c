"""The command line against a real server: info, demo, server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_model

from lmcache_kv_fast.cli import main


def test_info_json_lists_decoded_models(server_shm, capsys):
    m = make_model(server_shm, num_layers=3, num_kv_heads=4, head_size=64, layout="HND")
    assert main(["info", "--http-url", server_shm.http_url, "--model", m.name, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["server_version"].startswith("0.5.6")
    assert out["chunk_size"] == 256
    (entry,) = out["models"][m.name]
    assert entry["world_size"] == 1
    assert "NL_X_TWO_NB_NH_BS_HS" in entry["groups"][0]
    assert "[2, 3, 256, 256]" in entry["sdk"]


def test_info_text(server_pickle, capsys):
    m = make_model(server_pickle, mla=True, num_layers=2, head_size=576)
    assert main(["info", "--http-url", server_pickle.http_url]) == 0
    text = capsys.readouterr().out
    assert m.name in text and "pickle plane" in text


def test_demo_batch_small(server_shm, capsys):
    m = make_model(server_shm, num_layers=2, num_kv_heads=8, head_size=128)
    rc = main(["demo", "--url", server_shm.url, "--http-url", server_shm.http_url,
               "--model", m.name, "--sequences", "4", "--tokens", "600", "--layers", "2",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "4 items: 4 ok" in out


def test_server_command_starts_and_stops():
    env = {**os.environ}
    p = subprocess.Popen([sys.executable, "-m", "lmcache_kv_fast", "server", "--l1-size-gb", "0.25",
                          "--register", "cli-model", "--layers", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    info: dict = {}
    log_kept = False
    try:
        line = p.stdout.readline()
        info = json.loads(line)
        assert info["url"].startswith("tcp://127.0.0.1:") and info["shm"]
        assert info["env"]["MALLOC_ARENA_MAX"] == "1"  # the recommended deployment
        assert os.path.exists(f"/dev/shm/{info['shm']}")
        assert main(["info", "--http-url", info["http_url"], "--model", "cli-model", "--json"]) == 0
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
        # the user-facing server keeps its log (the path it printed); the test removes it
        if info.get("log"):
            log = Path(info["log"])
            log_kept = log.exists() and log.stat().st_size > 0
            log.unlink(missing_ok=True)
    time.sleep(0.2)
    assert not os.path.exists(f"/dev/shm/{info['shm']}")
    assert log_kept


def test_hybrid_model_refused_and_listed_per_group(server_pickle, capsys):
    import pytest

    import lmcache_kv_fast as lkf
    from lmcache_kv_fast.layout import EngineGroupInfo
    from lmcache_kv_fast.testing import register_vllm_layout

    name = f"hybrid-{os.getpid()}"
    register_vllm_layout(server_pickle.url, name, num_layers=4, num_kv_heads=4, head_size=64,
                         engine_groups=[
                             EngineGroupInfo(engine_group_id=0, layer_indices=(0, 2),
                                             tokens_per_block=16),
                             EngineGroupInfo(engine_group_id=1, layer_indices=(1, 3),
                                             tokens_per_block=16, sw_size_tokens=128)])
    with pytest.raises(lkf.KVCacheSDKError) as ei:
        lkf.connect(server_pickle.url, server_pickle.http_url, name)
    msg = str(ei.value)
    assert "2 kernel groups" in msg and "layers 0, 2" in msg and "layers 1, 3" in msg
    assert "block_size 16" in msg and "NL_X_TWO_NB_BS_NH_HS" in msg
    # nothing was registered for the model by the refused connect
    metas = server_pickle.status().get("non_cuda_context_meta", {}).values()
    assert not any(m.get("model_name") == name for m in metas)
    assert main(["info", "--http-url", server_pickle.http_url, "--model", name, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["models"][name]
    assert len(entry["groups"]) == 2 and "hybrid" in entry["sdk"]


def test_info_shows_what_connect_resolves_for_an_engine(server_shm, capsys, tmp_path):
    """A CPU engine's registration (engine-driven only): info names it and what connect() finds."""
    from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven

    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 256, "torch_dtype": "bfloat16"}))
    iid = register_engine_driven(server_shm.url, str(model), block_size=128, use_mla=True)
    try:
        assert main(["info", "--http-url", server_shm.http_url, "--model", str(model),
                     "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        e = doc["engine_driven"][str(model)]
        assert e["registrations"] == {str(iid): {"world_size": 1, "block_size": 128,
                                                 "use_mla": True}}
        assert e["connect"].startswith("CPU engine KV: 2 layers, 2 KV heads x 64, bfloat16, "
                                       "block_size 128, kernel ")
        assert main(["info", "--http-url", server_shm.http_url, "--model", "acme/none-such"]) == 0
        assert main(["info", "--http-url", server_shm.http_url]) == 0
        text = capsys.readouterr().out
        assert f"engine-driven model {str(model)!r}" in text and "connect() would use" in text
    finally:
        unregister_engine_driven(server_shm.url, iid)


def test_bench_engine_flags_are_checked_before_anything_starts():
    from benches.harness.cli import main as bench_main

    with pytest.raises(SystemExit, match="--engine-tokens must be in"):
        bench_main(["--engine", "--engine-tokens", "100"])
    with pytest.raises(SystemExit, match="--engine-prompts must be positive"):
        bench_main(["--workloads", "W5", "--engine-prompts", "0"])
