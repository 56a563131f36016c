"""``KVLayout``: the KV-cache geometry of a whole model, as the SDK user sees it.

A two-plane layout's contiguous KV tensor is ``[2, L, T, D]`` with
``D = num_kv_heads * head_dim`` (plane 0 = K, plane 1 = V); a single-plane (MLA)
layout's is ``[L, T, D]`` with ``D = head_dim`` (the latent width). With a KV world
size ``W > 1`` (tensor-parallel shards, docs/protocol.md §8.5) each shard of a two-plane
layout holds ``num_kv_heads / W`` heads, i.e. ``D / W`` columns of every plane; an
MLA latent is replicated, so every shard holds the full ``D``.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError

if TYPE_CHECKING:
    from lmcache_kv_fast.layout.decoded import DecodedEntry

__all__ = ["SUPPORTED_DTYPES", "KVLayout", "layout_from_hf_config", "normalize_dtype"]

logger = logging.getLogger(__name__)

#: Element types a layout may use.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def normalize_dtype(dtype: torch.dtype | str, name: str = "dtype") -> torch.dtype:
    """Turn a ``torch.dtype`` or its name into a supported ``torch.dtype``.

    Args:
        dtype: ``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` (torch's
            aliases such as ``"half"`` work too).
        name: Argument name used in error messages.

    Returns:
        The dtype.

    Raises:
        InvalidTypeError: ``dtype`` is neither a ``torch.dtype`` nor a str.
        InvalidArgumentError: Unknown or unsupported dtype.

    """
    supported = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.strip().removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidArgumentError(f"{name}: expected one of {supported}, got {dtype!r}")
        dtype = resolved
    elif not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(
            f"{name}: expected a torch.dtype or its name, got {type(dtype).__name__}"
        )
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(
            f"{name}: expected one of {supported}, got {_dtype_name(dtype)}"
        )
    return dtype


def _count(value: Any, name: str, *, minimum: int = 1) -> int:
    """Validate an integer argument (bools refused) and return it as ``int``."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{name}: expected an int >= {minimum}, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidTypeError(
            f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}"
        ) from None
    if number < minimum:
        raise InvalidArgumentError(f"{name}: expected an int >= {minimum}, got {number}")
    return number


@dataclass(frozen=True)
class KVLayout:
    """KV-cache geometry of a whole model (all tensor-parallel shards together).

    Args:
        num_layers: Layers ``L`` (KV tensors) of the model.
        num_kv_heads: The model's **total** KV heads; with world size ``W`` each
            shard holds ``num_kv_heads / W``. Must be 1 for MLA.
        head_dim: Width of one head (the latent width for MLA).
        dtype: ``torch.dtype`` or its name; stored as ``torch.dtype``. One of
            bfloat16, float16, float32, float64, float8_e4m3fn, float8_e5m2, int8,
            uint8.
        block_size: Tokens per engine block (the server's chunk size must be a
            multiple of it).
        mla: Single-plane layout (``[L, T, D]``): MLA latent cache, or any format
            whose chunk object has one plane.

    Raises:
        InvalidTypeError: An argument has the wrong type.
        InvalidArgumentError: An argument has the wrong value (non-positive count,
            unsupported dtype, MLA with ``num_kv_heads != 1``).

    Example:
        >>> lay = KVLayout(32, 8, 128, "bfloat16")
        >>> lay.tensor_shape(512)
        (2, 32, 512, 1024)

    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16
    mla: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "num_layers", _count(self.num_layers, "num_layers"))
        set_(self, "num_kv_heads", _count(self.num_kv_heads, "num_kv_heads"))
        set_(self, "head_dim", _count(self.head_dim, "head_dim"))
        set_(self, "block_size", _count(self.block_size, "block_size"))
        set_(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.mla, bool):
            raise InvalidTypeError(f"mla: expected a bool, got {type(self.mla).__name__}")
        if self.mla and self.num_kv_heads != 1:
            raise InvalidArgumentError(
                f"num_kv_heads: an MLA layout has one latent head (expected 1), got "
                f"{self.num_kv_heads}; pass the latent width as head_dim"
            )

    # ------------------------------------------------------------------ derived
    @property
    def planes(self) -> int:
        """Planes of the tensor and of every chunk object: 1 for MLA, else 2 (K, V)."""
        return 1 if self.mla else 2

    @property
    def hidden_size(self) -> int:
        """``D = num_kv_heads * head_dim`` of the whole model."""
        return self.num_kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def dtype_str(self) -> str:
        """Dtype name without ``"torch."``, as the wire wants it (``"bfloat16"``)."""
        return _dtype_name(self.dtype)

    def shard_hidden(self, world_size: int) -> int:
        """Hidden size held by one of ``world_size`` shards.

        Args:
            world_size: KV world size ``W`` (tensor-parallel shards).

        Returns:
            ``(num_kv_heads / W) * head_dim``; the full ``D`` for MLA (replicated).

        Raises:
            InvalidTypeError: ``world_size`` is not an int.
            InvalidArgumentError: ``world_size < 1``, or the heads do not split
                evenly over ``world_size`` shards.

        """
        world_size = _count(world_size, "world_size")
        if self.mla:
            return self.hidden_size
        if self.num_kv_heads % world_size:
            raise InvalidArgumentError(
                f"world_size: expected a divisor of num_kv_heads {self.num_kv_heads} "
                f"(each shard holds whole heads), got {world_size}"
            )
        return self.num_kv_heads // world_size * self.head_dim

    def tensor_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the whole model's contiguous KV tensor for ``tokens`` tokens.

        Args:
            tokens: Token count ``T`` (0 allowed).

        Returns:
            ``(2, L, T, D)``, or ``(L, T, D)`` for MLA.

        Raises:
            InvalidTypeError: ``tokens`` is not an int.
            InvalidArgumentError: ``tokens < 0``.

        """
        tokens = _count(tokens, "tokens", minimum=0)
        if self.mla:
            return (self.num_layers, tokens, self.hidden_size)
        return (2, self.num_layers, tokens, self.hidden_size)

    def chunk_shape(self, chunk_size: int, world_size: int = 1) -> tuple[int, ...]:
        """Shape of one engine-driven chunk object of one shard (docs/protocol.md §6.3).

        Args:
            chunk_size: Tokens per chunk ``C``.
            world_size: KV world size ``W``.

        Returns:
            ``(2, L, C, D / W)``, or ``(L, C, D)`` for MLA.

        Raises:
            InvalidTypeError: An argument is not an int.
            InvalidArgumentError: Non-positive arguments, or see :meth:`shard_hidden`.

        """
        chunk_size = _count(chunk_size, "chunk_size")
        width = self.shard_hidden(world_size)
        if self.mla:
            return (self.num_layers, chunk_size, width)
        return (2, self.num_layers, chunk_size, width)

    def describe(self) -> str:
        """One human-readable line, e.g. for logs and ``lmcache-kv-fast info``."""
        if self.mla:
            heads = f"1 latent head x {self.head_dim} (MLA)"
        else:
            heads = f"{self.num_kv_heads} KV heads x {self.head_dim}"
        dims = [str(self.num_layers), "T", str(self.hidden_size)]
        shape = ", ".join(dims if self.mla else ["2", *dims])
        return (
            f"{self.num_layers} layers, {heads} = D {self.hidden_size}, {self.dtype_str}, "
            f"block_size {self.block_size}, {self.planes} plane(s), tensor [{shape}]"
        )

    def diff(self, other: KVLayout) -> list[str]:
        """List the fields in which ``other`` differs from this layout.

        Args:
            other: The layout to compare with.

        Returns:
            A new list of ``"field: self_value != other_value"`` strings, empty
            when the layouts are equal.

        Raises:
            InvalidTypeError: ``other`` is not a :class:`KVLayout`.

        """
        if not isinstance(other, KVLayout):
            raise InvalidTypeError(f"other: expected a KVLayout, got {type(other).__name__}")
        out: list[str] = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                if f.name == "dtype":
                    mine, theirs = _dtype_name(mine), _dtype_name(theirs)
                out.append(f"{f.name}: {mine} != {theirs}")
        return out

    @classmethod
    def from_hf_config(cls, config: str | os.PathLike[str] | Mapping[str, Any], *,
                       dtype: torch.dtype | str | None = None, block_size: int = 16) -> KVLayout:
        """Build the layout from a Hugging Face model configuration.

        See :func:`layout_from_hf_config`: reads
        ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` (or ``hidden_size /
        num_attention_heads``) and ``dtype``/``torch_dtype``; MLA models give the
        single-plane latent layout; hybrid models are refused.

        Args:
            config: A model directory, its ``config.json``, a Hugging Face id in the local
                cache, or the configuration as a mapping.
            dtype: KV dtype, overriding the configuration's.
            block_size: Engine tokens per block.

        Returns:
            The model's layout.

        Raises:
            KVCacheSDKError: Not found (``ModelConfigNotFoundError``), missing or invalid
                fields, a hybrid model, or no dtype known.

        Example:
            >>> KVLayout.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4,
            ...     "num_key_value_heads": 2, "hidden_size": 256, "dtype": "bfloat16"},
            ...     block_size=128).tensor_shape(256)
            (2, 2, 256, 128)

        """
        return layout_from_hf_config(config, dtype=dtype, block_size=block_size)

    @classmethod
    def from_decoded(cls, entry: DecodedEntry, world_size: int | None = None) -> KVLayout:
        """Build the whole-model layout from a decoded ``/status`` entry.

        A shard's entry holds per-shard geometry, so a two-plane model's total heads
        are ``NH_shard * W``; an MLA latent is replicated. Single-plane non-MLA
        formats (packed K|V, independent K/V components) are represented as a
        one-plane layout (``mla=True``, one "head" of width D): byte-identical on
        the wire, but only for ``W == 1``.

        Args:
            entry: The decoded entry (see
                :func:`~lmcache_kv_fast.layout.decode.decode_status_entry`).
            world_size: Expected KV world size; ``None`` takes ``entry.world_size``.

        Returns:
            The model's layout.

        Raises:
            KVCacheSDKError: Hybrid entry (see ``require_single_group``), or a
                single-plane non-MLA format with ``W > 1``.
            InvalidArgumentError: ``world_size`` disagrees with the entry's.

        """
        chunk = entry.require_single_group()
        group = entry.groups[0]
        ws = entry.world_size
        if world_size is not None and _count(world_size, "world_size") != ws:
            raise InvalidArgumentError(
                f"world_size: the registration of {entry.model_name!r} has world_size "
                f"{ws}, got {world_size}"
            )
        if chunk.planes == 1:
            if not group.is_mla:
                if ws != 1:
                    raise KVCacheSDKError(
                        f"model {entry.model_name!r} uses the single-plane, head-sharded "
                        f"format {group.format_name} with world_size {ws}; this SDK "
                        "supports it only with world_size 1"
                    )
                logger.info(
                    "model %r: format %s has one plane; using a one-plane layout of D %d",
                    entry.model_name, group.format_name, chunk.hidden_size,
                )
            return cls(
                num_layers=chunk.num_layers,
                num_kv_heads=1,
                head_dim=chunk.hidden_size,
                dtype=chunk.dtype,
                block_size=chunk.block_size,
                mla=True,
            )
        if group.num_heads is None or group.head_size is None:  # pragma: no cover
            raise KVCacheSDKError(
                f"model {entry.model_name!r}: format {group.format_name} did not yield "
                "the head count"
            )
        return cls(
            num_layers=chunk.num_layers,
            num_kv_heads=group.num_heads * ws,
            head_dim=group.head_size,
            dtype=chunk.dtype,
            block_size=chunk.block_size,
            mla=False,
        )


def layout_from_hf_config(config: str | os.PathLike[str] | Mapping[str, Any], *,
                          dtype: torch.dtype | str | None = None, block_size: int = 16,
                          ) -> KVLayout:
    """KV layout of a model from its Hugging Face configuration.

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default
    ``num_attention_heads``), ``head_dim`` (default ``hidden_size //
    num_attention_heads``) and ``dtype``/``torch_dtype``, from ``text_config`` for
    multimodal models (:func:`~lmcache_kv_fast.layout.hf_config.hf_kv_geometry`). MLA
    models (DeepSeek-V2/V3 style: ``kv_lora_rank``) give a single-plane layout of width
    ``kv_lora_rank + qk_rope_head_dim``, which is what vLLM caches for them. Hybrid models
    (``layer_types`` with non-attention layers) are refused.

    Args:
        config: A model directory, its ``config.json``, a Hugging Face id in the local
            cache, or the configuration as a mapping.
        dtype: KV dtype; overrides the configuration's (pass it when the engine runs with
            another ``--dtype`` than the checkpoint's, or the config has none).
        block_size: Engine tokens per block (from ``/status`` or the engine's flags).

    Returns:
        The layout of the whole model (all KV heads).

    Raises:
        ModelConfigNotFoundError: The configuration cannot be found.
        KVCacheSDKError: A field is missing or invalid, the model is hybrid, or no dtype is
            known (the message names the field or what to pass).
        InvalidArgumentError: ``dtype`` or ``block_size`` is invalid.
    """
    from lmcache_kv_fast.layout.hf_config import hf_kv_geometry

    geo = hf_kv_geometry(config, dtype=dtype)
    try:
        return KVLayout(block_size=block_size, **geo)
    except InvalidArgumentError as err:
        where = f" of {config!r}" if isinstance(config, str | os.PathLike) else ""
        raise InvalidArgumentError(f"model configuration{where}: {err}") from err
