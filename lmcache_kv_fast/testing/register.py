"""Register a vLLM-like paged KV layout with a real server, the way a vLLM worker does.

This is ``register_kv_cache`` (docs/protocol.md §3.14 and §10.3), without importing ``lmcache``.
:func:`register_engine_driven` registers the way a CPU vLLM engine (or another process's SDK)
does: ``register_kv_cache_engine_driven_context``, which shows in ``/status``
``non_cuda_context_meta`` only.

One POSIX segment holds the per-layer CPU tensors; the server maps it during the call,
after which the name is unlinked (the server keeps its mapping).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

from lmcache_kv_fast.protocol.constants import DTYPE_ITEMSIZE
from lmcache_kv_fast.protocol.ops import GEN_056, Generation, Op
from lmcache_kv_fast.protocol.types import EngineGroupInfo
from lmcache_kv_fast.transport.zmq_client import ZmqClient

_SEG_COUNTER = itertools.count()

#: per-layer tensor shape (as a function of NB, BS, NH, HS, D) and layout hints
LAYOUTS = {
    # vLLM flash-attention NHD: NL x [2, NB, BS, NH, HS]  (format 1)
    "NHD": (lambda nb, bs, nh, hs: [2, nb, bs, nh, hs], {"kv_layout": "NHD"}),
    # vLLM flash-attention HND: NL x [2, NB, NH, BS, HS]  (format 6)
    "HND": (lambda nb, bs, nh, hs: [2, nb, nh, bs, hs], {"kv_layout": "HND"}),
    # FlashInfer NHD: NL x [NB, 2, BS, NH, HS]  (format 2)
    "FLASHINFER": (lambda nb, bs, nh, hs: [nb, 2, bs, nh, hs], {"kv_layout": "NHD"}),
    # MLA: NL x [NB, BS, D]  (format 3), no hints
    "MLA": (lambda nb, bs, nh, hs: [nb, bs, hs], {}),
}


def _strides(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


@dataclass
class VllmLikeRegistration:
    """What :func:`register_vllm_layout` registered (one entry per TP rank)."""

    url: str
    instance_ids: list[int]
    model_name: str
    world_size: int
    generation: Generation = GEN_056
    segments: list[str] = field(default_factory=list)

    def unregister(self, timeout: float = 10.0) -> None:
        """Send ``unregister_kv_cache`` for every rank."""
        client = ZmqClient(self.url, self.generation, timeout)
        try:
            for iid in self.instance_ids:
                client.call(Op.UNREGISTER_KV_CACHE, [iid])
        finally:
            client.close()


def register_vllm_layout(
    url: str, model_name: str, *, num_layers: int, num_kv_heads: int, head_size: int,
    dtype: str = "bfloat16", block_size: int = 16, num_blocks: int = 4, layout: str = "NHD",
    world_size: int = 1, generation: Generation = GEN_056, timeout: float = 30.0,
    engine_groups: list[EngineGroupInfo] | None = None,
) -> VllmLikeRegistration:
    """Register a vLLM-like layout: one ``register_kv_cache`` per TP rank.

    Args:
        url: ZMQ URL of the server.
        model_name: Model name to register.
        num_layers: L.
        num_kv_heads: Total KV heads of the model (each rank registers ``/world_size``);
            ignored for ``layout="MLA"``.
        head_size: Head size (for MLA: the latent width D).
        dtype: torch dtype name.
        block_size: Tokens per block.
        num_blocks: Blocks per layer tensor (only needs to be >= 1 for the SDK path).
        layout: ``"NHD"``, ``"HND"``, ``"FLASHINFER"`` or ``"MLA"``.
        world_size: Number of TP ranks to register.
        generation: Server generation (operation ids).
        timeout: Seconds per call.
        engine_groups: vLLM KV-cache groups (default: one full-attention group of all
            layers); several groups make a hybrid model.

    Returns:
        The registration (instance ids, for ``unregister``).
    """
    shape, hints = _rank_tensor_shape(layout, generation, num_kv_heads, world_size,
                                      num_blocks, block_size, head_size)
    nbytes = num_layers * _numel(shape) * DTYPE_ITEMSIZE[dtype]
    groups = list(engine_groups) if engine_groups else [
        EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(num_layers)),
                        tokens_per_block=block_size)]
    client = ZmqClient(url, generation, timeout)
    reg = VllmLikeRegistration(url, [], model_name, world_size, generation)
    try:
        for _rank in range(world_size):
            with _fresh_segment(nbytes) as seg:
                wrappers = _cpu_shm_wrappers(seg, nbytes, dtype, shape, num_layers)
                iid = secrets.randbits(31) + 1
                client.call(Op.REGISTER_KV_CACHE,
                            [iid, wrappers, model_name, world_size, "vllm", hints, groups])
                reg.instance_ids.append(iid)
        return reg
    finally:
        client.close()


def _rank_tensor_shape(layout: str, generation: Generation, num_kv_heads: int, world_size: int,
                       num_blocks: int, block_size: int, head_size: int
                       ) -> tuple[list[int], dict[str, str]]:
    """One rank's per-layer tensor shape and the layout hints, after checking the arguments.

    Raises:
        ValueError: An unknown ``layout``, or KV heads that do not split over the ranks.
        NotImplementedError: A server generation that takes pickled IPC wrappers.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if not generation.ipc_wrapper_ext:
        raise NotImplementedError(
            f"server generation {generation.name} takes pickled IPC wrappers; "
            "register with that version's own client"
        )
    shape_fn, hints = LAYOUTS[layout]
    nh = 1 if layout == "MLA" else num_kv_heads // world_size
    if layout != "MLA" and num_kv_heads % world_size:
        raise ValueError("num_kv_heads must be divisible by world_size")
    return shape_fn(num_blocks, block_size, nh, head_size), hints


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@contextlib.contextmanager
def _fresh_segment(nbytes: int) -> Iterator[str]:
    """A new POSIX segment of ``nbytes`` (touched once) as ``/name``; unlinked on exit.

    The server maps the segment while registering and keeps its mapping, so the name is
    not needed afterwards.
    """
    seg = f"/lmckvf_kv_{os.getpid()}_{next(_SEG_COUNTER)}_{secrets.token_hex(2)}"
    fd = os.open(f"/dev/shm{seg}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            mm[:16] = bytes(16)  # touch it
    finally:
        os.close(fd)
    try:
        yield seg
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm{seg}")


def _cpu_shm_wrappers(seg: str, nbytes: int, dtype: str, shape: list[int], num_layers: int
                      ) -> list[msgspec.msgpack.Ext]:
    """The ``cpu_shm`` IPC wrapper of every layer's tensor, back to back in ``seg``."""
    layer_elems = _numel(shape)
    return [
        msgspec.msgpack.Ext(1, msgspec.msgpack.encode({
            "type": "cpu_shm",
            "shm_name": seg,
            "nbytes": nbytes,
            "version": 1,
            "metadata": {
                "dtype": dtype,
                "shape": shape,
                "stride": _strides(shape),
                "storage_offset": layer * layer_elems,
                "device_uuid": "cpu",
            },
        }))
        for layer in range(num_layers)
    ]


def register_engine_driven(url: str, model_name: str, *, block_size: int, use_mla: bool,
                           num_layers: int = 2, hidden: int = 256, dtype: str = "bfloat16",
                           world_size: int = 1, chunk_size: int = 256,
                           generation: Generation = GEN_056, timeout: float = 10.0) -> int:
    """Register an engine-driven context as another process (a CPU engine, an SDK) would.

    A CPU vLLM engine of a ``L``-layer model with ``NH`` KV heads of ``HS`` registers
    ``use_mla=True``, ``hidden = NH*2*HS`` (its fused K|V rows). The instance id is random
    and not one of this process's own (``client/instances.py``).

    Returns:
        The instance id (for :func:`unregister_engine_driven`).
    """
    from lmcache_kv_fast.protocol.types import (
        RegisterEngineDrivenContextPayload,
        RegisterEngineDrivenContextResponse,
    )

    iid = secrets.randbits(62) + 1
    payload = RegisterEngineDrivenContextPayload(
        instance_id=iid, model_name=model_name, world_size=world_size, block_size=block_size,
        num_layers=num_layers, hidden_dim_size=hidden, dtype_str=dtype, use_mla=use_mla,
        num_physical_slots=chunk_size)
    client = ZmqClient(url, generation, timeout)
    try:
        client.call(Op.REGISTER_ENGINE_DRIVEN, [payload], RegisterEngineDrivenContextResponse)
    finally:
        client.close()
    return iid


def unregister_engine_driven(url: str, instance_id: int, *, generation: Generation = GEN_056,
                             timeout: float = 10.0) -> None:
    """Unregister an engine-driven context.

    Upstream 0.5.6's ``close()`` leaves its own to the server's reaper, which waits an hour
    for a never-pinged instance.
    """
    client = ZmqClient(url, generation, timeout)
    try:
        client.call(Op.UNREGISTER_ENGINE_DRIVEN, [int(instance_id)], None)
    finally:
        client.close()
