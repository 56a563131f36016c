"""SHM data plane: the server's L1 pool segment, mapped once per context (docs/protocol.md §7.1-7.3)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from types import ModuleType

from lmcache_kv_fast.copy.base import ChunkGeometry, Region, Segment
from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError
from lmcache_kv_fast.protocol.types import Slot

logger = logging.getLogger(__name__)


def check_slots_match(slots: Sequence[Slot], geom: ChunkGeometry, dtype_str: str,
                      what: str) -> None:
    """Check slot descriptors describe objects of our geometry (docs/protocol.md §7.2).

    Accepts ``[P, L, C, W]`` and, for single-plane objects, ``[1, L, C, W]``/``[L, C, W]``.

    Raises:
        ProtocolError: Dtype, element count or length differ.
    """
    want = geom.chunk_nbytes
    elems = want // geom.itemsize
    obj = list(geom.object_shape())
    # Same-size objects of another geometry would be silently reinterpreted: refuse them.
    shapes = (obj, obj[1:]) if geom.planes == 1 else (obj,)
    for k, s in enumerate(slots):
        if s.dtype.removeprefix("torch.") != dtype_str:
            raise ProtocolError(f"{what}: slot {k} has dtype {s.dtype!r}, expected {dtype_str!r}")
        if any(d < 0 for d in s.shape) or math.prod(s.shape) != elems or s.length != want or \
                list(s.shape) not in shapes:
            raise ProtocolError(
                f"{what}: slot {k} is {s.shape} / {s.length} bytes, expected "
                f"{list(geom.object_shape())} / {want} bytes"
            )


class ShmPlane:
    """The mapped L1 pool of one context.

    Args:
        backend: Copy backend module (opens the segment).
        name: Pool segment name from the registration reply.
        size: ``pool_size`` from the registration reply.
        align: Slot alignment to enforce.
    """

    def __init__(self, backend: ModuleType, name: str, size: int, align: int) -> None:
        self.name = name
        self.align = align
        if type(size) is not int or size <= 0:
            raise ProtocolError(f"the registration reply names SHM pool {name!r} with "
                                f"pool_size {size!r}: expected a positive size")
        try:
            self.segment: Segment | None = backend.open_segment(name, size)
        except FileNotFoundError as err:
            raise KVCacheSDKError(
                f"the server's SHM pool /dev/shm/{name} does not exist here: the SDK must run "
                "on the same machine (and IPC namespace) as the server"
            ) from err
        except PermissionError as err:
            raise KVCacheSDKError(
                f"no permission to map the server's SHM pool /dev/shm/{name} (mode 0600): run "
                "the SDK as the server's user"
            ) from err
        except (OSError, ValueError) as err:
            raise KVCacheSDKError(f"cannot map the server's SHM pool {name!r}: {err}") from err

    def regions(self, slots: Sequence[Slot], geom: ChunkGeometry, dtype_str: str,
                what: str) -> list[Region]:
        """Validate ``slots`` fully and return their regions in the mapping.

        Raises:
            ProtocolError: A slot does not fit our geometry or the mapping.
        """
        if self.segment is None:
            raise KVCacheSDKError("the SHM mapping is closed")
        check_slots_match(slots, geom, dtype_str, what)
        try:
            return self.segment.regions(slots, geom.chunk_nbytes, self.align)
        except ValueError as err:
            raise ProtocolError(f"{what}: refused slot descriptor: {err}") from err

    def check_mapped(self, slots: Sequence[Slot], geom: ChunkGeometry, what: str) -> None:
        """Check slots that already passed :meth:`regions` still fit the mapping now.

        For a reply naming exactly the slots validated a moment ago (read hints): only
        the segment can have changed since (a peer that shrank it).

        Raises:
            ProtocolError: A slot no longer fits the mapping.
        """
        if self.segment is None:
            raise KVCacheSDKError("the SHM mapping is closed")
        try:
            self.segment.regions(slots, geom.chunk_nbytes, self.align)
        except ValueError as err:
            raise ProtocolError(f"{what}: refused slot descriptor: {err}") from err

    def close(self) -> None:
        """Unmap (idempotent)."""
        seg, self.segment = self.segment, None
        if seg is not None:
            seg.close()
