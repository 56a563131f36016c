"""``dst.copy_(src)`` for two same-shape strided CPU views, on the native copy pool.

Torch's generic copy walks a permutation (e.g. a CPU engine's KV rows <-> per-token K/V,
``layout/cpu_engine.py``) element by element along the destination's innermost dimension;
when that dimension is strided in the source (a transpose) it runs at a fraction of
memory speed. The native ``strided_copy`` tiles the two dimensions that are innermost on
either side and splits the rest over the copy pool (``benches/bench_engine_convert.py``
compares the two; docs/performance.md, "A CPU engine's per-token KV").

Falls back to ``torch.Tensor.copy_`` with the torch backend, for other dtypes/devices,
misaligned views, and whatever the native planner refuses.
"""

from __future__ import annotations

import torch

from lmcache_kv_fast.copy.select import backend

__all__ = ["copy_view"]


def copy_view(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype, CPU, non-negative strides)."""
    be = backend()
    if be.NAME != "native" or dst.shape != src.shape or dst.dtype != src.dtype or \
            dst.device.type != "cpu" or src.device.type != "cpu" or dst.numel() == 0:
        dst.copy_(src)
        return
    native = be._native  # the extension, as the native backend imported it
    isz = dst.element_size()
    ds, ss = dst.untyped_storage(), src.untyped_storage()
    dbase, sbase = ds.data_ptr(), ss.data_ptr()
    doff, soff = dst.data_ptr() - dbase, src.data_ptr() - sbase
    if doff % isz or soff % isz or min(dst.stride(), default=0) < 0 or \
            min(src.stride(), default=0) < 0:
        dst.copy_(src)
        return
    try:
        native.strided_copy(dbase, ds.nbytes(), doff // isz, sbase, ss.nbytes(), soff // isz,
                             isz, list(dst.shape), list(dst.stride()), list(src.stride()))
    except ValueError:
        dst.copy_(src)  # e.g. a layout the planner does not take: torch's semantics
