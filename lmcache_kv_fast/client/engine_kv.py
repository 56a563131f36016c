"""A CPU vLLM engine behind the server: its geometry at connect, its KV per token.

A CPU vLLM engine (``LMCacheMPConnector`` on CPU) registers engine-driven, so ``/status``
has no ``cache_context_meta`` entry for its model; only ``non_cuda_context_meta`` shows
``{model_name, world_size, block_size, use_mla}`` (docs/engine-kv-layout.md §4). When
``connect()`` gets no ``layout=`` and finds no vLLM registration, :func:`resolve_layout`
derives the geometry from the model's configuration and that registration
(:func:`~lmcache_kv_fast.layout.resolve_engine_layout`), leaving out the ids this
process's own contexts registered under (:mod:`.instances`).

The server's objects of such an engine are the engine's raw rows ``[L, C, NH*2*HS]``, in
the attention kernel's in-block order. The session registers and moves those (its
``layout`` is the raw single-plane layout); per call, :class:`EngineKVCopy` turns the copy
between the objects and the caller's tensor into a conversion to / from the documented
per-token ``[2, L, T, NH*HS]`` K/V, chunk by chunk, straight from / into the SHM slots (or
inline frames): one strided copy per plane, no intermediate buffer
(:class:`~lmcache_kv_fast.layout.CpuEngineKV`). The exception is a store into a slot whose
pages the server's pool has never held (a fresh pool, a pool that grew): written through
the mapping, every 4 KiB page faults, is allocated, zeroed and mapped (kernel time per
page, high on a VM). Such a chunk is
converted into a reused per-thread staging buffer instead and written by the copy core's
raw scatter, whose cold-page path fills the pages without faulting or zeroing them
(``UFFDIO_COPY`` or ``pwritev``; ``csrc/native.cpp``).

:func:`per_token` switches a call on the calling thread to per-token mode: the session's
``Session.copy`` and ``alloc_result`` ask
:func:`active` for the converter.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast.client.instances import own_instance_ids
from lmcache_kv_fast.copy import ChunkGeometry, Region
from lmcache_kv_fast.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
    ProtocolError,
)
from lmcache_kv_fast.layout import (
    CpuEngineKV,
    EngineLayoutUnresolvedError,
    KVLayout,
    resolve_engine_layout,
)
from lmcache_kv_fast.layout.hf_config import ModelConfigNotFoundError

if TYPE_CHECKING:
    from lmcache_kv_fast.client.state import SessionState

__all__ = ["EngineKVCopy", "EngineOptions", "active", "per_token", "resolve_layout"]

logger = logging.getLogger(__name__)

#: What to pass when the geometry cannot be found (every error of this module ends so).
WHAT_TO_PASS = (
    "pass model_config=<path to the model directory or its config.json, or the config as a "
    "dict> (when the model name is not a local directory or a Hugging Face id in the local "
    "cache), block_size=<the engine's vLLM block size> (when the engine is not registered "
    "(any more) or registrations disagree), dtype=<KV dtype> (when the engine ran another "
    "--dtype than the config's), or the whole geometry: layout=KVLayout(...)"
)


@dataclass(frozen=True)
class EngineOptions:
    """What ``connect()`` may say about a CPU engine (all optional).

    Attributes:
        model_config: The model's configuration: a directory, its ``config.json``, a
            Hugging Face id in the local cache, or the configuration as a dict. Default:
            the model name (vLLM registers the path or id it was started with).
        block_size: The engine's vLLM block size (picks among disagreeing registrations,
            or describes an engine that is not registered).
        dtype: KV dtype when the engine ran with another ``--dtype`` than the config's.
        kernel: The engine's attention kernel (``"vec"``, ``"vec16"``, ``"amx"``) when the
            engine runs on another machine (default: what vLLM picks on this one).
    """

    model_config: str | os.PathLike[str] | Mapping[str, Any] | None = None
    block_size: int | None = None
    dtype: torch.dtype | str | None = None
    kernel: str | None = None

    def __post_init__(self) -> None:
        mc = self.model_config
        if mc is not None and not isinstance(mc, (str, os.PathLike, Mapping)):
            raise InvalidTypeError(
                "model_config: expected a path (model directory or config.json), a Hugging "
                f"Face id or a dict, got {type(mc).__name__}"
            )
        bs = self.block_size
        if bs is not None and (type(bs) is not int or bs < 1):
            raise InvalidArgumentError(f"block_size: expected a positive int, got {bs!r}")
        if self.dtype is not None and not isinstance(self.dtype, (torch.dtype, str)):
            raise InvalidTypeError(
                f"dtype: expected a torch.dtype or its name, got {type(self.dtype).__name__}"
            )
        if self.kernel is not None and not isinstance(self.kernel, str):
            raise InvalidTypeError(f"kernel: expected a str, got {type(self.kernel).__name__}")

    @property
    def given(self) -> bool:
        """Whether any option was passed."""
        return any(v is not None for v in (self.model_config, self.block_size, self.dtype,
                                           self.kernel))


def resolve_layout(s: SessionState, status: Mapping[str, Any], world_size: int | None,
                   opts: EngineOptions, no_vllm: str) -> tuple[KVLayout, int]:
    """The layout and world size of an engine-driven (CPU) engine's model.

    Sets ``s.engine_kv`` (the converter, or None for a two-plane engine whose objects are
    per-token already) and ``s.token_layout``.

    Args:
        s: The session being connected.
        status: ``/status``.
        world_size: ``connect(world_size=)``.
        opts: ``connect()``'s engine options.
        no_vllm: The sentence saying no vLLM registration was found (starts the error).

    Raises:
        KVCacheSDKError: The geometry cannot be derived; the message says what to pass.
    """
    try:
        res = resolve_engine_layout(
            status, s.model_name, model_config=opts.model_config, dtype=opts.dtype,
            block_size=opts.block_size, world_size=world_size, kernel=opts.kernel,
            exclude_instance_ids=own_instance_ids(),
        )
    except (EngineLayoutUnresolvedError, ModelConfigNotFoundError) as err:
        raise KVCacheSDKError(f"{no_vllm}; {err}. To connect, {WHAT_TO_PASS}") from err
    except KVCacheSDKError as err:
        if type(err) is not KVCacheSDKError:
            raise  # e.g. UnsupportedEngineLayoutError, InvalidArgumentError: already precise
        raise KVCacheSDKError(f"{no_vllm}; {err}. To connect, {WHAT_TO_PASS}") from err
    if res.cpu is not None and s.chunk_size % res.cpu.block_size:
        raise KVCacheSDKError(
            f"the server's chunk size {s.chunk_size} is not a multiple of the engine's block "
            f"size {res.cpu.block_size}: its chunks would split engine blocks (restart the "
            "server with --chunk-size a multiple of the block size)"
        )
    s.engine_kv = res.cpu
    s.token_layout = res.token_layout
    logger.info("model %r: engine-driven registration resolved: %s", s.model_name,
                res.describe())
    return res.layout, res.world_size


@contextlib.contextmanager
def per_token(s: SessionState, enabled: bool) -> Iterator[EngineKVCopy | None]:
    """Run the enclosed call of this thread in per-token mode when ``enabled``.

    Yields the converter (None when not enabled or the session has none).
    """
    conv = s.engine_copy() if enabled else None
    if conv is None:
        yield None
        return
    tls = s.tls
    prev = getattr(tls, "engine_copy", None)
    tls.engine_copy = conv
    try:
        yield conv
    finally:
        tls.engine_copy = prev


def active(s: SessionState) -> EngineKVCopy | None:
    """The converter of the call running on this thread, or None (raw copies)."""
    return getattr(s.tls, "engine_copy", None)


def _cold(r: Region) -> bool:
    """Whether ``r`` lies in SHM pages the pool has never held (False without a mapping)."""
    m = getattr(r, "mapping", None)
    if m is None:
        return False
    try:
        return bool(m.cold(r.addr, r.nbytes))
    except ValueError:  # the segment closed meanwhile: the copy itself reports it
        return False


class EngineKVCopy:
    """Chunk copies between the engine's raw objects and per-token K/V.

    Args:
        cpu: The engine's converter.
        geom: The session's chunk geometry (single plane, ``[L, C, NH*2*HS]``).
        gather_fn: The backend's gather (a copy called with it is a read, else a write).
    """

    def __init__(self, cpu: CpuEngineKV, geom: ChunkGeometry, gather_fn: Any) -> None:
        if geom.planes != 1 or geom.width != cpu.num_kv_heads * 2 * cpu.head_dim or \
                geom.chunk_tokens % cpu.block_size:
            raise KVCacheSDKError(f"chunk geometry {geom} does not hold {cpu.describe()}")
        self.cpu = cpu
        self.geom = geom
        self._gather = gather_fn
        self._obj = (geom.layers, geom.chunk_tokens, geom.width)
        self._tls = threading.local()  # per thread: its staging chunk for cold stores

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """Per-token shape of ``tokens`` tokens: ``[2, L, T, NH*HS]``."""
        return self.cpu.token_layout.tensor_shape(tokens)

    def copy(self, fn: Any, t: torch.Tensor, chunk_ids: Sequence[int],
             regions: Sequence[Region]) -> None:
        """Gather (``fn`` is the backend's gather) or scatter chunks, converting each.

        Raises:
            ProtocolError: A region of the wrong size (never from validated slots).
            InvalidArgumentError: ``t`` is not ``[2, L, >=C*(max id + 1), NH*HS]``.
        """
        if len(chunk_ids) != len(regions):
            raise ProtocolError(f"{len(chunk_ids)} chunk ids for {len(regions)} regions")
        c = self.geom.chunk_tokens
        tokens = t.shape[-2] if t.dim() == 4 else 0
        read = fn is self._gather
        for i, r in zip(chunk_ids, regions, strict=True):
            i = int(i)
            if not 0 <= i < tokens // c:
                raise InvalidArgumentError(
                    f"chunk {i} outside the {tokens}-token tensor {list(t.shape)}"
                )
            part = t.narrow(-2, i * c, c)
            if not read and _cold(r):
                # never-allocated pool pages: convert here, fill them with the core's
                # cold-page path (module docstring)
                staging = self._staging()
                self.cpu.to_raw(part, out=staging)
                fn(staging, self.geom, [0], [r], 0)
                continue
            obj = self._view(r, write=not read)
            if read:
                self.cpu.to_tokens(obj, out=part)
            else:
                self.cpu.to_raw(part, out=obj)

    def _staging(self) -> torch.Tensor:
        """This thread's ``[L, C, W]`` chunk buffer (made once and reused: stays faulted)."""
        buf: torch.Tensor | None = getattr(self._tls, "staging", None)
        if buf is None:
            buf = torch.empty(self._obj, dtype=self.cpu.dtype)
            self._tls.staging = buf
        return buf

    def _view(self, r: Region, *, write: bool) -> torch.Tensor:
        """The region's object as a ``[L, C, W]`` tensor (its own memory, no copy).

        Regions come validated (SHM slots against the mapping, pickle or envelope spans
        against the frame); a misaligned span of a received frame is copied once (read only).
        """
        nbytes = self.geom.chunk_nbytes
        if r.nbytes != nbytes:
            raise ProtocolError(f"a region of {r.nbytes} bytes, expected {nbytes}")
        flat = r.tensor
        if flat is None:
            buf = (ctypes.c_char * nbytes).from_address(r.addr)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        elif flat.numel() != nbytes:
            raise ProtocolError(f"a region tensor of {flat.numel()} bytes, expected {nbytes}")
        if r.addr % self.geom.itemsize:
            if write:
                raise ProtocolError(f"a destination region at a misaligned address {r.addr:#x}")
            flat = flat.clone()
        return flat.view(self.cpu.dtype).view(self._obj)
