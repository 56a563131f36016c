"""RoPE from config.json and re-rotation, checked against ``transformers`` (fast tier).

The oracle is transformers 5 in the engine venv: ``rope_oracle_child.py`` rotates the same
raw keys at old and at new positions with transformers' own RoPE code, for every variant
and both pair styles. ``rerotate`` of the old keys must give the new ones to float32
rounding (the oracle's own float32 angles at position ``p`` are off by up to ``p * 2^-24``
rad, which sets the tolerance) and to bfloat16 rounding for bfloat16 KV. Skipped, with the
reason, only when the engine venv is missing.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch

from lmcache_kv_fast import edits
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from testbed.engine_proc import EngineChildError, child_env, engine_python

CHILD = Path(__file__).with_name("rope_oracle_child.py")
T = 24
H = 2
DH = 64
BASE = {"model_type": "llama", "hidden_size": H * DH, "num_attention_heads": H,
        "num_key_value_heads": H, "head_dim": DH, "max_position_embeddings": 4096}

#: name -> (config.json dict, largest old position, rope_from_config kwargs)
VARIANTS: dict[str, tuple[dict, int, dict]] = {
    "default_new": ({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                    1500, {}),
    "default_old": ({**BASE, "rope_theta": 500000.0, "rope_scaling": None}, 1500, {}),
    "linear_old": ({**BASE, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "linear", "factor": 4.0}}, 1500, {}),
    "dynamic_short": ({**BASE, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                       "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 1500, {}),
    "dynamic_long": ({**BASE, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 3000,
                     {"dynamic_seq_len": "max+1"}),
    "llama3_new": ({**BASE, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, 3000, {}),
    "yarn_new": ({**BASE, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
        "original_max_position_embeddings": 32768}}, 3000, {}),
    "yarn_mscale_old": ({**BASE, "max_position_embeddings": 16384, "rope_theta": 10000.0,
                         "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                          "mscale_all_dim": 0.5, "beta_fast": 16,
                                          "original_max_position_embeddings": 4096}}, 1500, {}),
    "partial_old": ({**BASE, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 1500, {}),
    "partial_llama3_new": ({**BASE, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "partial_rotary_factor": 0.25}}, 1500, {}),
}
STYLES = {"neox": False, "interleaved": True}
CASES = [(v, s) for v in VARIANTS for s in STYLES]
DROP_K = 3


def _positions(name: str, top: int) -> tuple[list[int], list[int]]:
    """Sorted distinct old positions up to ``top`` and new ones (0..T-1; a shift for one)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    old = torch.randperm(top, generator=gen)[:T].sort().values.tolist()
    new = [p + 100 for p in old] if name.startswith("default_new") else list(range(T))
    return old, new


def _oracle_cases() -> list[dict]:
    """Every (variant, style) case, plus the drop-then-rerotate composition cases."""
    cases = []
    for v, s in CASES:
        cfg, top, _ = VARIANTS[v]
        old, new = _positions(v, top)
        oracle_cfg = {k: x for k, x in cfg.items() if k != "model_type"}
        cases.append({"name": f"{v}/{s}", "config": oracle_cfg, "interleaved": STYLES[s],
                      "old": old, "new": new})
        # composition: K rotated at 0..T-1; row i's position after dropping every k-th
        cases.append({"name": f"{v}/{s}/compose", "config": oracle_cfg,
                      "interleaved": STYLES[s], "old": list(range(T)),
                      "new": [i - (i + 1) // DROP_K for i in range(T)]})
    return cases


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Raw keys and transformers' rotated keys for every case (one child run)."""
    try:
        python = engine_python()
    except EngineChildError as exc:
        pytest.skip(f"transformers oracle unavailable: {exc}")
    tmp = tmp_path_factory.mktemp("rope_oracle")
    k = torch.randn(T, H, DH, generator=torch.Generator().manual_seed(7))
    cases = _oracle_cases()
    torch.save({"k": k, "cases": cases}, tmp / "in.pt")
    proc = subprocess.run([str(python), str(CHILD), str(tmp / "in.pt"), str(tmp / "out.pt")],
                          env=child_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"oracle child failed: {proc.stderr[-3000:]}"
    return {"k": k, "cases": {c["name"]: c for c in cases}, "ref": torch.load(tmp / "out.pt")}


def _rope(variant: str, style: str, case: dict | None = None) -> edits.RoPE:
    """The variant's RoPE; ``dynamic_seq_len="max+1"`` becomes the case's ``max(pos) + 1``.

    That is the length transformers' dynamic RoPE computes its frequencies for when the
    old and new positions go through one forward (as the oracle does).
    """
    cfg, _, kw = VARIANTS[variant]
    if kw.get("dynamic_seq_len") == "max+1":
        assert case is not None
        kw = {**kw, "dynamic_seq_len": max(case["old"] + case["new"]) + 1}
    return edits.rope_from_config(copy.deepcopy(cfg), interleaved=STYLES[style], **kw)


def _kv(k_rot: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """``[2, 1, T, H*DH]`` KV whose K is ``k_rot`` ``[T, H, DH]`` and V random."""
    v = torch.randn(k_rot.shape, generator=torch.Generator().manual_seed(seed))
    return torch.stack([k_rot.reshape(1, k_rot.shape[0], -1), v.reshape(1, v.shape[0], -1)])


def _fp32_tol(top: int, k: torch.Tensor) -> float:
    """The oracle's own float32 angle error at positions up to ``top``, times |k|."""
    return 4 * (top + T) * 2.0 ** -24 * float(k.abs().max()) * 4 + 1e-5


@pytest.mark.parametrize(("variant", "style"), CASES)
def test_frequencies_match_transformers(oracle: dict, variant: str, style: str) -> None:
    """rope_from_config reads both config forms as transformers does (frequencies, mscale)."""
    rope = _rope(variant, style, oracle["cases"][f"{variant}/{style}"])
    ref = oracle["ref"][f"{variant}/{style}"]
    torch.testing.assert_close(rope.inv_freq(), ref["inv_freq"].float(), rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(ref["attention_scaling"], rel=1e-9)
    assert rope.interleaved is STYLES[style]


@pytest.mark.parametrize(("variant", "style"), CASES)
def test_rerotate_fp32_matches_transformers(oracle: dict, variant: str, style: str) -> None:
    """rerotate(K at old) == K at new; V bit-exact; non-rotary dims untouched; no in-place."""
    rope = _rope(variant, style, oracle["cases"][f"{variant}/{style}"])
    case, ref = oracle["cases"][f"{variant}/{style}"], oracle["ref"][f"{variant}/{style}"]
    kv = _kv(ref["k_old"])
    before = kv.clone()
    out = edits.rerotate(kv, case["old"], rope, case["new"])
    assert torch.equal(kv, before), "the caller's tensor changed"
    assert torch.equal(out[1], kv[1]), "V changed"
    got = out[0, 0].reshape(T, H, DH)
    tol = _fp32_tol(max(case["old"] + case["new"]), ref["k_new"])
    torch.testing.assert_close(got, ref["k_new"], rtol=0, atol=tol)
    rd = rope.rotary_dim
    if rd < DH:
        assert torch.equal(got[..., rd:], ref["k_old"][..., rd:])
        assert torch.equal(got[..., rd:], oracle["k"][..., rd:])


@pytest.mark.parametrize(("variant", "style"), CASES)
def test_rerotate_bf16_matches_transformers(oracle: dict, variant: str, style: str) -> None:
    """bf16 KV: K to bf16 rounding of the reference (fp32 math inside), V bit-exact."""
    rope = _rope(variant, style, oracle["cases"][f"{variant}/{style}"])
    case, ref = oracle["cases"][f"{variant}/{style}"], oracle["ref"][f"{variant}/{style}"]
    kv = _kv(ref["k_old"]).to(torch.bfloat16)
    out = edits.rerotate(kv, torch.tensor(case["old"]), rope, torch.tensor(case["new"]))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[1], kv[1])
    kmax = float(ref["k_new"].abs().max())
    torch.testing.assert_close(out[0, 0].reshape(T, H, DH).float(), ref["k_new"], rtol=0,
                               atol=2.0 ** -7 * kmax)


@pytest.mark.parametrize(("variant", "style"), CASES)
def test_drop_then_rerotate_equals_rotating_kept_keys(oracle: dict, variant: str,
                                                       style: str) -> None:
    """drop_every(k, rope) on K at 0..T-1 == the kept raw keys rotated at 0..T'-1."""
    rope = _rope(variant, style, oracle["cases"][f"{variant}/{style}/compose"])
    ref = oracle["ref"][f"{variant}/{style}/compose"]
    kv = _kv(ref["k_old"])
    tokens = list(range(1000, 1000 + T))
    out, kept = edits.drop_every(DROP_K, rope=rope)(kv, tokens)
    idx = [i for i in range(T) if i % DROP_K != DROP_K - 1]
    assert kept == [tokens[i] for i in idx]
    assert torch.equal(out[1], kv[1][:, idx])
    torch.testing.assert_close(out[0, 0].reshape(len(idx), H, DH), ref["k_new"][idx], rtol=0,
                               atol=_fp32_tol(T, ref["k_new"]))


def test_zero_shift_is_identity_and_copy() -> None:
    """Old == new positions: the values come back unchanged, in a new tensor."""
    rope = edits.rope_from_config(VARIANTS["default_new"][0])
    kv = torch.randn(2, 3, 5, H * DH)
    out = edits.rerotate(kv, range(5), rope)
    assert torch.equal(out, kv) and out.data_ptr() != kv.data_ptr()


def test_inplace_rotates_the_given_tensor() -> None:
    """inplace=True writes into kv and returns it."""
    rope = edits.rope_from_config(VARIANTS["default_new"][0])
    kv = torch.randn(2, 2, 4, H * DH)
    expected = edits.rerotate(kv, [3, 5, 8, 9], rope)
    out = edits.rerotate(kv, [3, 5, 8, 9], rope, inplace=True)
    assert out is kv and torch.equal(kv, expected)


# ------------------------------------------------------------------ config forms
def test_config_path_and_directory(tmp_path: Path) -> None:
    """A path to config.json or to the model directory reads like the dict."""
    cfg = VARIANTS["llama3_new"][0]
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    want = edits.rope_from_config(cfg)
    assert edits.rope_from_config(tmp_path) == want
    assert edits.rope_from_config(str(tmp_path / "config.json")) == want
    assert want.rope_type == "llama3" and want.factor == 8.0


def test_head_dim_from_hidden_size_and_gptj_names() -> None:
    """head_dim = hidden/heads when absent; GPT-J's names, rotary_dim and interleaving."""
    rope = edits.rope_from_config({"model_type": "mistral", "hidden_size": 4096,
                                   "num_attention_heads": 32, "rope_theta": 1e6})
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved) == (128, 128, False)
    gptj = edits.rope_from_config({"model_type": "gptj", "n_embd": 4096, "n_head": 16,
                                   "rotary_dim": 64})
    assert (gptj.head_dim, gptj.rotary_dim, gptj.interleaved, gptj.theta) == \
        (256, 64, True, 10000.0)
    neox = edits.rope_from_config({"model_type": "gpt_neox", "hidden_size": 512,
                                   "num_attention_heads": 8, "rotary_pct": 0.25})
    assert (neox.head_dim, neox.rotary_dim) == (64, 16)


def test_unknown_rope_type_is_named() -> None:
    """An unknown rope_type is a ValueError (and a KVCacheSDKError) naming it."""
    cfg = {**BASE, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="longrope") as info:
        edits.rope_from_config(cfg)
    assert isinstance(info.value, KVCacheSDKError)


@pytest.mark.parametrize("cfg", [
    {"model_type": "gpt2", "n_embd": 768, "n_head": 12},
    {"model_type": "falcon", "hidden_size": 512, "num_attention_heads": 8, "alibi": True},
    {"model_type": "mystery", "hidden_size": 512, "num_attention_heads": 8},
])
def test_model_without_rope_is_refused(cfg: dict) -> None:
    """A model without RoPE: a clear error when re-rotation is asked."""
    with pytest.raises(InvalidArgumentError, match="nothing to re-rotate"):
        edits.rope_from_config(cfg)


def test_rerotate_without_rope_is_refused() -> None:
    """rerotate(rope=None) says a RoPE is needed."""
    with pytest.raises(InvalidArgumentError, match="rope_from_config"):
        edits.rerotate(torch.zeros(2, 1, 2, 64), [0, 1], None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cfg", "match"), [
    ({**BASE, "rope_scaling": {"type": "linear"}}, "factor"),
    ({**BASE, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({**BASE, "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({**BASE, "rope_parameters": {"full_attention": {"rope_type": "default"},
                                  "sliding_attention": {"rope_type": "default"}}},
     "per layer type"),
    ({"model_type": "llama", "rope_theta": 1e4}, "head_dim"),
    ({**BASE, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4},
     "per layer type"),
    ({**BASE, "model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "rope_theta": 1e4}, "MLA"),
])
def test_bad_configs_are_named(cfg: dict, match: str) -> None:
    """Missing or out-of-range parameters: an error naming what is wrong."""
    with pytest.raises(InvalidArgumentError, match=match):
        edits.rope_from_config(cfg)


def test_config_of_wrong_type() -> None:
    """A config that is neither a mapping nor a path is a type error."""
    with pytest.raises(InvalidTypeError, match="config"):
        edits.rope_from_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kv", "old", "match"), [
    (torch.zeros(2, 4, 64), [0, 1, 2, 3], r"\[2, L, T, D\]"),
    (torch.zeros(3, 1, 4, 64), [0, 1, 2, 3], r"\[2, L, T, D\]"),
    (torch.zeros(2, 1, 4, 96), [0, 1, 2, 3], "whole number of heads"),
    (torch.zeros(2, 1, 4, 64), [0, 1, 2], "expected 4 positions"),
    (torch.zeros(2, 1, 4, 64), [0, -1, 2, 3], ">= 0"),
    (torch.zeros(2, 1, 4, 64, dtype=torch.int32), [0, 1, 2, 3], "float32"),
])
def test_rerotate_shape_errors(kv: torch.Tensor, old: list[int], match: str) -> None:
    """Shape, head and position mismatches are named."""
    rope = edits.rope_from_config(VARIANTS["default_new"][0])
    with pytest.raises(InvalidArgumentError, match=match):
        edits.rerotate(kv, old, rope)


# ------------------------------------------------------------------ a real model's layer 0
#: The tiny Llama's RoPE replaced by these (same weights): rope_parameters of config.json.
MODEL_ROPES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024},
}



def _model_with_rope(src: Path, dst: Path, rope_parameters: dict | None) -> Path:
    """``src``'s files linked into ``dst`` with ``rope_parameters`` in its config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if rope_parameters is not None:
        cfg["rope_parameters"] = rope_parameters
    (dst / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return dst


@pytest.mark.parametrize("variant", list(MODEL_ROPES))
def test_layer0_of_the_shortened_prompt(oracle_model: Path, tmp_path: Path, variant: str) -> None:
    """drop_every + rope on a real model's KV == that model's KV of the shortened prompt.

    Layer 0's K and V depend only on the token and its position, so after dropping and
    re-rotating they must equal (to float32 rounding) what transformers computes for the
    kept tokens alone; without re-rotation K must not.
    """
    from testbed.oracle import TransformersOracle

    model = _model_with_rope(oracle_model, tmp_path / variant, MODEL_ROPES[variant])
    rope = edits.rope_from_config(model)
    assert rope.rope_type == variant
    tokens = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    with TransformersOracle(model) as oracle:
        full = oracle.kv(tokens)
        out, kept = edits.drop_every(4, rope=rope)(full, tokens)
        short = oracle.kv(kept)
    assert len(kept) == 225 and out.shape == short.shape
    scale = float(short[:, 0].abs().max())
    torch.testing.assert_close(out[1, 0], short[1, 0], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(out[0, 0], short[0, 0], rtol=0, atol=1e-4 * scale)
    stale, _ = edits.drop_every(4)(full, tokens)
    assert float((stale[0, 0] - short[0, 0]).abs().max()) > 100 * 1e-4 * scale
