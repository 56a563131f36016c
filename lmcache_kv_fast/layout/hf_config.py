"""KV geometry from a Hugging Face model configuration (``config.json``).

An engine-driven registration (a CPU vLLM, every SDK) publishes only ``model_name,
world_size, block_size, use_mla`` in ``/status``; layers, heads, head size and dtype have
to come from the model itself. vLLM registers the model by the string it was started
with (``model_config.model``): a local directory or a Hugging Face id.
:func:`load_hf_config` finds that model's ``config.json`` without network access (a
local directory or file, or the Hugging Face cache), and :func:`hf_kv_geometry` reads the
KV geometry out of it (:meth:`KVLayout.from_hf_config
<lmcache_kv_fast.layout.KVLayout.from_hf_config>` and
:func:`~lmcache_kv_fast.layout.kvlayout.layout_from_hf_config` make the layout; this
module does not import ``kvlayout``, so the two never import each other).

Pure file reading; neither ``transformers`` nor ``lmcache`` is imported.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lmcache_kv_fast.errors import InvalidTypeError, KVCacheSDKError

__all__ = [
    "ModelConfigNotFoundError",
    "hf_cache_dirs",
    "hf_kv_geometry",
    "load_hf_config",
]

logger = logging.getLogger(__name__)

#: Layer kinds that keep a KV cache (anything else makes the model hybrid).
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


class ModelConfigNotFoundError(KVCacheSDKError):
    """The model's ``config.json`` could not be found; the message says what to pass."""


def hf_cache_dirs() -> list[Path]:
    """Hugging Face hub cache directories to search, in order.

    ``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``, ``$TRANSFORMERS_CACHE``
    and ``~/.cache/huggingface/hub`` (duplicates removed).
    """
    cands: list[Path] = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]))
    if os.environ.get("HF_HOME"):
        cands.append(Path(os.environ["HF_HOME"]) / "hub")
    if os.environ.get("TRANSFORMERS_CACHE"):
        cands.append(Path(os.environ["TRANSFORMERS_CACHE"]))
    cands.append(Path.home() / ".cache" / "huggingface" / "hub")
    seen: list[Path] = []
    for c in cands:
        if c not in seen:
            seen.append(c)
    return seen


def _from_hub_cache(model_id: str) -> Path | None:
    """``config.json`` of ``org/name`` in a hub cache (the ``main`` ref, else the newest)."""
    if model_id.count("/") != 1 or model_id.startswith(("/", ".")):
        return None
    repo = "models--" + model_id.replace("/", "--")
    for cache in hf_cache_dirs():
        base = cache / repo
        snaps = base / "snapshots"
        if not snaps.is_dir():
            continue
        ref = base / "refs" / "main"
        if ref.is_file():
            cfg = snaps / ref.read_text().strip() / "config.json"
            if cfg.is_file():
                return cfg
        found = sorted((p / "config.json" for p in snaps.iterdir()
                        if (p / "config.json").is_file()),
                       key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            if len(found) > 1:
                logger.warning("%s: %d cached snapshots and no refs/main; using the newest %s",
                               model_id, len(found), found[0].parent.name)
            return found[0]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise KVCacheSDKError(f"cannot read the model configuration {path}: {err}") from err
    if not isinstance(data, dict):
        raise KVCacheSDKError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_hf_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Load a model configuration.

    Args:
        config: A mapping (used as is); a path to ``config.json`` or to a model directory
            holding one; or a Hugging Face id (``org/name``) found in the local hub cache
            (see :func:`hf_cache_dirs`; nothing is downloaded). An object with
            ``to_dict()`` (a ``transformers`` config) works too.

    Returns:
        The configuration as a new dict.

    Raises:
        ModelConfigNotFoundError: Nothing found; the message lists where it looked.
        InvalidTypeError: ``config`` has an unsupported type.
        KVCacheSDKError: The file is not a JSON object.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict") and not isinstance(config, str | os.PathLike):
        return dict(config.to_dict())
    if not isinstance(config, str | os.PathLike):
        raise InvalidTypeError(
            "model_config: expected a path, a Hugging Face id or a dict, got "
            f"{type(config).__name__}"
        )
    text = os.fspath(config)
    path = Path(text).expanduser()
    if path.is_file():
        return _read_json(path)
    if (path / "config.json").is_file():
        return _read_json(path / "config.json")
    cached = _from_hub_cache(text)
    if cached is not None:
        return _read_json(cached)
    where = [f"{path / 'config.json'}"] + [str(c) for c in hf_cache_dirs()]
    raise ModelConfigNotFoundError(
        f"cannot find the configuration of model {text!r} (looked for a config.json file or "
        f"directory, then the Hugging Face cache: {', '.join(where)}). Pass "
        "model_config=<the model directory, its config.json, or a dict of it>"
    )


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder part of a multimodal config (``text_config``), else the config itself."""
    if "num_hidden_layers" not in cfg:
        for key in ("text_config", "language_config", "llm_config"):
            sub = cfg.get(key)
            if isinstance(sub, Mapping) and "num_hidden_layers" in sub:
                return sub
    return cfg


def _pos_int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KVCacheSDKError(
            f"model configuration{where}: {key} must be a positive int, got {value!r}"
        )
    return value


def _config_dtype(cfg: Mapping[str, Any], outer: Mapping[str, Any]) -> str | None:
    for source in (cfg, outer):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str) and value not in ("auto", ""):
                return value.removeprefix("torch.")
    return None


def hf_kv_geometry(config: str | os.PathLike[str] | Mapping[str, Any], *,
                   dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """KV geometry of a model from its Hugging Face configuration, as ``KVLayout`` fields.

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default
    ``num_attention_heads``), ``head_dim`` (default ``hidden_size //
    num_attention_heads``) and ``dtype``/``torch_dtype``, from ``text_config`` for
    multimodal models. MLA models (DeepSeek-V2/V3 style: ``kv_lora_rank``) give a
    single-plane layout of width ``kv_lora_rank + qk_rope_head_dim``, which is what vLLM
    caches for them. Hybrid models (``layer_types`` with non-attention layers) are refused.

    Args:
        config: See :func:`load_hf_config`.
        dtype: KV dtype; overrides the configuration's (pass it when the engine runs with
            another ``--dtype`` than the checkpoint's, or the config has none).

    Returns:
        ``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype`` (unvalidated) and ``mla``
        of the whole model (all KV heads): the arguments of
        :class:`~lmcache_kv_fast.layout.KVLayout` but ``block_size``
        (:func:`~lmcache_kv_fast.layout.kvlayout.layout_from_hf_config` builds the layout).

    Raises:
        ModelConfigNotFoundError: The configuration cannot be found.
        KVCacheSDKError: A field is missing or invalid, the model is hybrid, or no dtype is
            known (the message names the field or what to pass).
    """
    outer = load_hf_config(config)
    cfg = _text_config(outer)
    where = f" of {config!r}" if isinstance(config, str | os.PathLike) else ""
    num_layers = _pos_int(cfg, "num_hidden_layers", where)
    types = cfg.get("layer_types")
    if isinstance(types, list | tuple):
        other = sorted({str(t) for t in types} - _ATTENTION_LAYER_TYPES)
        if other:
            raise KVCacheSDKError(
                f"model configuration{where}: hybrid model (layer_types include {other}); "
                "only models whose every layer keeps a KV cache are supported"
            )
    if dtype is None:
        dtype = _config_dtype(cfg, outer)
        if dtype is None:
            raise KVCacheSDKError(
                f"model configuration{where} names no dtype (dtype/torch_dtype); pass "
                "dtype=<the engine's KV dtype, e.g. 'bfloat16'>"
            )
    if cfg.get("kv_lora_rank"):
        width = _pos_int(cfg, "kv_lora_rank", where) + int(cfg.get("qk_rope_head_dim") or 0)
        return {"num_layers": num_layers, "num_kv_heads": 1, "head_dim": width,
                "dtype": dtype, "mla": True}
    heads = _pos_int(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _pos_int(cfg, "num_key_value_heads", where)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = _pos_int(cfg, "hidden_size", where)
        if hidden % heads:
            raise KVCacheSDKError(
                f"model configuration{where}: hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads} and there is no head_dim"
            )
        head_dim = hidden // heads
    else:
        head_dim = _pos_int(cfg, "head_dim", where)
    return {"num_layers": num_layers, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": dtype, "mla": False}
