"""Find a CPU vLLM engine's KV geometry from ``/status`` plus the model's configuration.

A CPU vLLM engine registers engine-driven (``LMCacheMPConnector`` on CPU), so ``/status``
shows only ``non_cuda_context_meta: {instance_id: {model_name, world_size, block_size,
use_mla}}`` for it, ``cache_context_meta`` stays empty, and every SDK instance's own
registration appears in the same table with the same four fields. The rest of the
geometry comes from the model (:func:`~lmcache_kv_fast.layout.hf_config.load_hf_config`:
the name vLLM registers is its path or id) and the in-block order from the attention
kernel vLLM picks (:func:`~lmcache_kv_fast.layout.cpu_engine.select_cpu_kernel`).

Telling the engine's entry from SDKs' (vLLM's worker uses a random 63-bit instance id,
like the SDKs, so the id says nothing): entries whose id the caller names in
``exclude_instance_ids`` (its own contexts) are dropped; the rest of the model's entries
must agree on ``(world_size, block_size, use_mla)``. An SDK registered with the engine's
geometry is then indistinguishable from the engine and harmless (same keys, same object
layout); a disagreeing one makes the answer ambiguous, and the error lists the entries
and names the argument (``block_size=``) that picks one. A CPU engine of a non-MLA model
registers ``use_mla: true`` (its fused K|V cache is one plane); ``use_mla: false`` is a
two-plane engine (no in-block reordering).

Pure data; no I/O except reading the model's ``config.json``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout.cpu_engine import CpuEngineKV, select_cpu_kernel
from lmcache_kv_fast.layout.kvlayout import KVLayout, layout_from_hf_config

__all__ = ["EngineLayoutUnresolvedError", "EngineResolution", "resolve_engine_layout"]


class EngineLayoutUnresolvedError(KVCacheSDKError):
    """The engine's geometry cannot be derived; the message says exactly what to pass."""


@dataclass(frozen=True)
class EngineResolution:
    """What ``connect()`` needs for an engine-driven (non-CUDA) registration.

    Attributes:
        layout: The layout to register and move: for a CPU engine the single-plane raw
            layout ``[L, T, NH*2*HS]`` (``cpu.raw_layout``), else the two-plane one.
        cpu: The CPU engine's converter (raw rows <-> per-token K/V), or None when the
            engine's objects are already per-token (two-plane engine-driven registration).
        world_size: KV world size of the registration.
        instance_ids: The ``non_cuda_context_meta`` ids taken as the engine's (empty when
            resolved from explicit arguments only).
        token_layout: The per-token two-plane layout users see.
    """

    layout: KVLayout
    cpu: CpuEngineKV | None
    world_size: int
    instance_ids: tuple[str, ...]
    token_layout: KVLayout

    def describe(self) -> str:
        """One line for logs."""
        who = f"engine entries {list(self.instance_ids)}" if self.instance_ids else "arguments"
        what = self.cpu.describe() if self.cpu else self.token_layout.describe()
        return f"{what} (from {who}, world_size {self.world_size})"


def _engine_entries(status: Mapping[str, Any], model_name: str,
                    exclude: Collection[str]) -> list[tuple[str, Mapping[str, Any]]]:
    meta = status.get("non_cuda_context_meta") if isinstance(status, Mapping) else None
    if not isinstance(meta, Mapping):
        return []
    return [(str(iid), e) for iid, e in meta.items()
            if isinstance(e, Mapping) and e.get("model_name") == model_name
            and str(iid) not in exclude]


def _near_names(status: Mapping[str, Any], model_name: str) -> list[str]:
    """Registered model names that point at the same directory as ``model_name``."""
    meta = status.get("non_cuda_context_meta") if isinstance(status, Mapping) else None
    if not isinstance(meta, Mapping) or not os.path.isdir(model_name):
        return []
    mine = os.path.realpath(model_name)
    names = {str(e.get("model_name")) for e in meta.values() if isinstance(e, Mapping)}
    return sorted(n for n in names if n != model_name and os.path.isdir(n)
                  and os.path.realpath(n) == mine)


def resolve_engine_layout(
    status: Mapping[str, Any], model_name: str, *,
    model_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    dtype: torch.dtype | str | None = None, block_size: int | None = None,
    world_size: int | None = None, kernel: str | None = None, amx: bool | None = None,
    exclude_instance_ids: Collection[int | str] = (), fused: bool | None = None,
) -> EngineResolution:
    """Derive the layout (and converter) of a model with no ``cache_context_meta`` entry.

    The module docstring says how the engine's registration is told from SDKs'.

    Args:
        status: ``GET /status`` JSON.
        model_name: The model name exactly as the engine registered it.
        model_config: The configuration (a directory, ``config.json``, a hub id or a
            dict); default ``model_name`` (a local directory or a cached hub id).
        dtype: KV dtype when the engine's ``--dtype`` is not the config's.
        block_size: The engine's block size: picks among disagreeing registrations, or
            describes an engine that is not registered (any more).
        world_size: Expected KV world size.
        kernel: The engine's attention kernel (``"vec"``, ``"vec16"``, ``"amx"``) if it runs elsewhere.
        amx: Whether the engine's CPU has AMX (default: this machine's).
        exclude_instance_ids: The caller's own SDK instance ids (never the engine).
        fused: Whether the engine's objects are the CPU fused single-plane format;
            default the registration's ``use_mla`` (True without a registration).

    Returns:
        The layout to register, the CPU converter (or None) and the engine's entries.

    Raises:
        EngineLayoutUnresolvedError: No usable registration and no ``block_size``, ambiguous
            registrations, or an MLA model registered two-plane; the message says what to pass.
        ModelConfigNotFoundError: No configuration found (says to pass ``model_config=``).
        KVCacheSDKError: Invalid configuration (missing fields, hybrid model, no dtype),
            world size other than 1 for a CPU engine, or an MLA model on a CPU engine.
        UnsupportedEngineLayoutError: The kernel's order is not verified.
    """
    entries = _engine_entries(status, model_name, {str(i) for i in exclude_instance_ids})
    entries = _filter_entries(entries, block_size=block_size, world_size=world_size,
                              fused=fused)
    found = _agreed_registration(entries, model_name)
    if found is not None:
        geometry = found
    elif block_size is not None:
        geometry = _Geometry(world_size or 1, block_size, True if fused is None else fused, ())
    else:
        raise _unregistered_error(status, model_name)
    tok = layout_from_hf_config(model_name if model_config is None else model_config,
                                dtype=dtype, block_size=geometry.block_size)
    if not geometry.fused:
        return _two_plane_resolution(tok, geometry, model_name)
    return _cpu_resolution(tok, geometry, model_name, kernel=kernel, amx=amx)


@dataclass(frozen=True)
class _Geometry:
    """The engine's registration, or what the arguments describe in its place."""

    world_size: int
    block_size: int
    fused: bool  # the registration's use_mla: one fused K|V plane
    instance_ids: tuple[str, ...]


def _filter_entries(
    entries: list[tuple[str, Mapping[str, Any]]], *, block_size: int | None,
    world_size: int | None, fused: bool | None,
) -> list[tuple[str, Mapping[str, Any]]]:
    """Keep the registrations that fit the arguments given (each ``None`` keeps all)."""
    if block_size is not None:
        entries = [(i, e) for i, e in entries if e.get("block_size") == block_size]
    if world_size is not None:
        entries = [(i, e) for i, e in entries if e.get("world_size") == world_size]
    if fused is not None:
        entries = [(i, e) for i, e in entries if bool(e.get("use_mla")) == fused]
    return entries


def _agreed_registration(
    entries: list[tuple[str, Mapping[str, Any]]], model_name: str
) -> _Geometry | None:
    """The geometry every entry agrees on; ``None`` without entries.

    Raises:
        EngineLayoutUnresolvedError: The entries disagree (the message lists them).
        KVCacheSDKError: The agreed block size is not a positive int.
    """
    groups: dict[tuple[Any, Any, bool], list[str]] = {}
    for iid, e in entries:
        key = (e.get("world_size"), e.get("block_size"), bool(e.get("use_mla")))
        groups.setdefault(key, []).append(iid)
    if len(groups) > 1:
        listing = "; ".join(f"{ids}: world_size {k[0]}, block_size {k[1]}, use_mla {k[2]}"
                            for k, ids in groups.items())
        raise EngineLayoutUnresolvedError(
            f"model {model_name!r} has engine-driven registrations that disagree ({listing}); "
            "pass block_size=<the engine's vLLM block size> (and world_size=) to pick the "
            "engine's, or layout=KVLayout(...)"
        )
    if not groups:
        return None
    (ws, bs, use_mla), ids = next(iter(groups.items()))
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise KVCacheSDKError(f"/status: registration {ids} has block_size {bs!r}")
    ws = ws if isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1 else 1
    return _Geometry(ws, bs, use_mla, tuple(ids))


def _unregistered_error(status: Mapping[str, Any], model_name: str) -> EngineLayoutUnresolvedError:
    """The error for a model with no registration and no ``block_size=``."""
    near = _near_names(status, model_name)
    hint = f" (registered under another spelling of that path: {near})" if near else ""
    return EngineLayoutUnresolvedError(
        f"no engine registration for model {model_name!r} in /status non_cuda_context_meta"
        f"{hint}: start the engine first, or pass block_size=<the engine's vLLM block "
        "size> (+ model_config=<model dir, config.json or dict> if the name is not a "
        "local directory) to describe a CPU engine, or layout=KVLayout(...)"
    )


def _two_plane_resolution(tok: KVLayout, geometry: _Geometry,
                          model_name: str) -> EngineResolution:
    """A two-plane engine: its objects are already per-token (no converter)."""
    if tok.mla:
        raise EngineLayoutUnresolvedError(
            f"model {model_name!r} is MLA but its registration is two-plane (use_mla "
            "false); pass layout=KVLayout(...)"
        )
    return EngineResolution(tok, None, geometry.world_size, geometry.instance_ids, tok)


def _cpu_resolution(tok: KVLayout, geometry: _Geometry, model_name: str, *,
                    kernel: str | None, amx: bool | None) -> EngineResolution:
    """A CPU engine's fused K|V objects: the raw layout plus the kernel's converter."""
    if tok.mla:
        raise KVCacheSDKError(
            f"model {model_name!r} is an MLA model on a CPU engine: its CPU cache layout is "
            "not verified; pass layout=KVLayout(..., mla=True) and use the raw rows"
        )
    if geometry.world_size != 1:
        raise KVCacheSDKError(
            f"model {model_name!r}: a CPU engine's fused K|V objects are supported with "
            f"world_size 1 only (registration has {geometry.world_size})"
        )
    kern = kernel or select_cpu_kernel(tok.dtype, geometry.block_size, tok.head_dim, amx=amx)
    cpu = CpuEngineKV.from_token_layout(tok, kern)
    return EngineResolution(cpu.raw_layout, cpu, geometry.world_size, geometry.instance_ids,
                            tok)
