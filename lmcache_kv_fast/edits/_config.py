"""Read a model's RoPE out of its ``config.json`` (both the new and the older form).

transformers 5 writes ``rope_parameters`` (``rope_type``, ``rope_theta``, scaling keys);
older configs have a top-level ``rope_theta`` and a ``rope_scaling`` dict (``type`` or
``rope_type``). Both are read the way transformers standardises them. Models whose
positions are not rotary (absolute embeddings, ALiBi) are refused with the reason: there
is nothing to re-rotate.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcache_kv_fast.edits._rope import ROPE_TYPES, RoPE
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["rope_from_config"]

#: Families without rotary positions (absolute embeddings or ALiBi).
_NO_ROPE = frozenset({"gpt2", "gpt_bigcode", "bloom", "mpt", "opt", "bert", "roberta", "t5",
                      "bart", "jais", "xglm", "biogpt", "gpt_neo"})
#: Families whose rotary pairs are interleaved ``(2i, 2i+1)`` (GPT-J's ``rotate_every_two``).
_INTERLEAVED = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "chatglm"})
#: Families that are rotary even when the config names no RoPE parameter (theta 10000).
_ROPE_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                            "qwen3_moe", "gemma", "gemma2", "phi", "phi3", "gpt_neox", "gptj",
                            "codegen", "stablelm", "internlm2", "olmo", "olmo2", "granite",
                            "cohere", "starcoder2", "deepseek", "yi", "baichuan"})
_DEFAULT_THETA = 10000.0


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The config as a dict: a mapping as is, a path to ``config.json`` or its directory."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise InvalidArgumentError(f"config: expected a config.json dict or path, "
                                       f"no file at {path}")
        with path.open(encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"config: {path} holds a {type(data).__name__}, "
                                       f"expected a JSON object")
        return data
    raise InvalidTypeError(f"config: expected a dict or a path to config.json, got "
                           f"{type(config).__name__}")


def _first(cfg: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` present (and not None) in ``cfg``."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return None


def _head_dim(cfg: Mapping[str, Any]) -> int:
    """``head_dim``, else hidden size over attention heads (any of the usual key names)."""
    head_dim = cfg.get("head_dim")
    if head_dim:
        return int(head_dim)
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    if not hidden or not heads:
        raise InvalidArgumentError("config: expected head_dim, or hidden_size and "
                                   "num_attention_heads, to know the head size; found neither")
    return int(hidden) // int(heads)


def _check_rotary(cfg: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """Refuse a model without rotary positions (the message says why)."""
    model_type = str(cfg.get("model_type") or "")
    pos_type = str(cfg.get("position_embedding_type") or "")
    if cfg.get("alibi") or pos_type in ("alibi", "absolute", "learned") or model_type in _NO_ROPE:
        why = "ALiBi" if (cfg.get("alibi") or pos_type == "alibi") else "absolute positions"
        raise InvalidArgumentError(
            f"config: model_type {model_type or '?'!r} has no rotary position embedding "
            f"({why}): there is nothing to re-rotate; pass rope=None")
    if not params and cfg.get("rope_theta") is None and model_type not in _ROPE_FAMILIES:
        raise InvalidArgumentError(
            f"config: no RoPE parameters (rope_parameters, rope_theta, rope_scaling) for "
            f"model_type {model_type or '?'!r}: a model without RoPE has nothing to re-rotate "
            f"(pass rope=None); a RoPE model needs rope_theta in its config")


def _rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (new form) or ``rope_scaling`` (old form), one flat dict."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(f"config: rope_parameters / rope_scaling must be an object, "
                                   f"got {type(params).__name__}")
    if cfg.get("rope_local_base_freq") is not None:
        why = "rope_local_base_freq: local layers use another base"
    elif params and all(isinstance(v, Mapping) for v in params.values()):
        why = f"nested {sorted(params)}"
    else:
        return dict(params)
    raise InvalidArgumentError(
        f"config: RoPE differs per layer type ({why}); re-rotation takes one RoPE: build one "
        f"per layer type (rope_from_config on a config holding that type's parameters)")


def _rotary_dim(cfg: Mapping[str, Any], params: Mapping[str, Any], head_dim: int) -> int:
    """Rotating dims per head: ``rope_dim`` / ``rotary_dim``, else a partial factor."""
    dim = _first(params, "rope_dim") or _first(cfg, "rotary_dim")
    if dim is None:
        frac = _first(params, "partial_rotary_factor")
        frac = _first(cfg, "partial_rotary_factor", "rotary_pct") if frac is None else frac
        frac = 1.0 if frac is None else float(frac)
        if not 0.0 < frac <= 1.0:
            raise InvalidArgumentError(f"config: partial_rotary_factor must be in (0, 1], "
                                       f"got {frac}")
        dim = int(head_dim * frac)
    dim = int(dim)
    if dim <= 0 or dim > head_dim or dim % 2:
        raise InvalidArgumentError(f"config: rotary dims must be even and in (0, head_dim="
                                   f"{head_dim}], got {dim}")
    return dim


def _need(params: Mapping[str, Any], rope_type: str, *names: str) -> None:
    """Refuse a scaled variant whose config lacks a required key."""
    missing = [n for n in names if params.get(n) is None]
    if missing:
        raise InvalidArgumentError(f"config: rope_type {rope_type!r} needs {missing} in "
                                   f"rope_parameters / rope_scaling; got keys {sorted(params)}")


def _yarn_attention_factor(params: Mapping[str, Any], factor: float) -> float:
    """YaRN's magnitude factor (mscale), as transformers infers it."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _scaling(cfg: Mapping[str, Any], params: Mapping[str, Any], rope_type: str,
             ) -> dict[str, Any]:
    """The variant's fields of :class:`RoPE` (factor, lengths, band and ramp parameters)."""
    max_pos = cfg.get("max_position_embeddings")
    out: dict[str, Any] = {"max_position_embeddings": int(max_pos) if max_pos else None}
    if rope_type == "default":
        return out
    orig = _first(params, "original_max_position_embeddings")
    orig = _first(cfg, "original_max_position_embeddings") if orig is None else orig
    orig = max_pos if orig is None else orig
    out["original_max_position_embeddings"] = int(orig) if orig else None
    if rope_type == "yarn":
        factor = params.get("factor")
        if factor is None:
            if not (max_pos and orig):
                _need(params, rope_type, "factor")
            factor = max_pos / orig
        out.update(factor=float(factor), attention_factor=_yarn_attention_factor(params, factor),
                   beta_fast=float(params.get("beta_fast") or 32),
                   beta_slow=float(params.get("beta_slow") or 1),
                   truncate=bool(params.get("truncate", True)))
        return out
    _need(params, rope_type, "factor")
    out["factor"] = float(params["factor"])
    if rope_type == "llama3":
        _need(params, rope_type, "low_freq_factor", "high_freq_factor")
        out.update(low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]))
    return out


def rope_from_config(config: Mapping[str, Any] | str | os.PathLike[str], *,
                     interleaved: bool | None = None,
                     dynamic_seq_len: int | None = None) -> RoPE:
    """Read a model's RoPE from its ``config.json`` (a dict, the file or its directory).

    Both forms are read: transformers 5's ``rope_parameters`` and the older top-level
    ``rope_theta`` + ``rope_scaling``. A multimodal config's ``text_config`` is used when
    the top level names no RoPE.

    Args:
        config: The config dict, or a path to ``config.json`` or to the model directory.
        interleaved: Override the pair layout (None: interleaved for GPT-J-like families
            and ``rope_interleave: true``, neox ``rotate_half`` otherwise — vLLM's
            ``is_neox_style`` is per model class and not in the config).
        dynamic_seq_len: For ``dynamic``: the sequence length the cached keys' frequencies
            were computed for (None: the unscaled base, see :class:`RoPE`).

    Returns:
        The frozen :class:`RoPE`.

    Raises:
        InvalidArgumentError: An unknown ``rope_type`` (named), a model without RoPE, a
            per-layer-type RoPE, missing or out-of-range parameters. (A ``ValueError``.)
        InvalidTypeError: ``config`` is neither a mapping nor a path.
    """
    cfg = _load(config)
    if isinstance(cfg.get("text_config"), Mapping) and not (
            cfg.get("rope_parameters") or cfg.get("rope_scaling") or cfg.get("rope_theta")):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type")
               or cfg.get("model_type")}
    if cfg.get("kv_lora_rank"):
        raise InvalidArgumentError(
            "config: an MLA model (kv_lora_rank) caches one latent plane, not [2, L, T, D]; "
            "re-rotating its qk_rope_head_dim part is not supported")
    params = _rope_params(cfg)
    _check_rotary(cfg, params)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type not in ROPE_TYPES:
        raise InvalidArgumentError(f"config: unknown rope_type {rope_type!r}; re-rotation "
                                   f"supports {list(ROPE_TYPES)}")
    if "mrope_section" in params:
        raise InvalidArgumentError("config: multimodal RoPE (mrope_section) has 3-D positions; "
                                   "re-rotation supports 1-D positions only")
    head_dim = _head_dim(cfg)
    theta = _first(params, "rope_theta")
    theta = _first(cfg, "rope_theta") if theta is None else theta
    if interleaved is None:
        interleaved = bool(cfg.get("rope_interleave")) or cfg.get("model_type") in _INTERLEAVED
    if dynamic_seq_len is not None and int(dynamic_seq_len) <= 0:
        raise InvalidArgumentError(f"dynamic_seq_len: expected a positive length, got "
                                   f"{dynamic_seq_len}")
    return RoPE(rope_type=rope_type, head_dim=head_dim,
                rotary_dim=_rotary_dim(cfg, params, head_dim),
                theta=float(_DEFAULT_THETA if theta is None else theta),
                interleaved=bool(interleaved),
                dynamic_seq_len=None if dynamic_seq_len is None else int(dynamic_seq_len),
                **_scaling(cfg, params, rope_type))
