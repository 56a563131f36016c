"""How a batch runs the user's edit ``fn``: output memory and intra-op threads.

A plain edit (``kv.index_select(2, idx)``, ``torch.cat``, ``kv.clone()``, ...) gets its
large outputs from glibc, which page-faults fresh memory on every call (often costlier
than the edit) and cannot be made to reuse such blocks reliably. So while the edit runs,
on its thread only, :class:`PooledOutputs` computes them with the ``out=`` form of the
same operator into the native core's pool of already-faulted result buffers. A buffer is
recycled only after the last tensor over it died; values, shapes, strides and dtypes are
those of the plain call; views, in-place, random and data-dependent ops run unchanged.

:func:`set_thread_intraop_threads` sets the OpenMP thread count of the edit thread only
(default: the caller's, at most the usable cores). Off switches: ``rewrite(...,
pool_outputs=False, edit_threads=n)``, ``LMCACHE_KV_FAST_POOL_OUTPUTS=0``,
``LMCACHE_KV_FAST_EDIT_THREADS=n``. The measurements behind this: docs/performance.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.batch._gather import GATHER_OPS, Gather, gather_call
from lmcache_kv_fast.batch._shapes import fast_out_meta
from lmcache_kv_fast.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

ENV_POOL_OUTPUTS = "LMCACHE_KV_FAST_POOL_OUTPUTS"
ENV_EDIT_THREADS = "LMCACHE_KV_FAST_EDIT_THREADS"

#: Outputs smaller than this come from torch's allocator as usual. From 1 MiB glibc's heap
#: does not reuse freed outputs reliably (see ``copy.native_backend.MIN_POOLED_RESULT_BYTES``).
MIN_POOLED_BYTES = 1 << 20

AllocFn = Callable[[Sequence[int], torch.dtype], torch.Tensor]

try:  # torch >= 1.13
    from torch.utils._python_dispatch import TorchDispatchMode as _Mode
except ImportError:  # pragma: no cover - very old torch
    _Mode = None  # type: ignore[assignment,misc]

_SKIP_TAGS = tuple(getattr(torch.Tag, n) for n in (
    "nondeterministic_seeded", "dynamic_output_shape", "data_dependent_output",
    "inplace_view", "view_copy") if hasattr(torch, "Tag") and hasattr(torch.Tag, n))


@dataclass(frozen=True)
class OutPlan:
    """The ``out=`` overload that computes an operator's result into a given tensor.

    ``drop`` names keyword arguments the ``out=`` form does not take because the output
    tensor carries them (``_to_copy``'s dtype); they must then be None or CPU/strided.
    """

    overload: Any
    out_name: str
    drop: tuple[str, ...] = ()

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor) -> Any:
        """Run the ``out=`` form into ``out``."""
        if self.drop:
            kwargs = {k: v for k, v in kwargs.items() if k not in self.drop}
        return self.overload(*args, **kwargs, **{self.out_name: out})

    def accepts(self, kwargs: dict[str, Any]) -> bool:
        """Whether the dropped arguments are implied by a contiguous CPU output."""
        if not self.drop:
            return True
        return kwargs.get("layout") in (None, torch.strided) and \
            kwargs.get("device") in (None, "cpu", torch.device("cpu")) and \
            not kwargs.get("pin_memory")


def _to_copy_plan() -> OutPlan | None:
    try:
        return OutPlan(torch.ops.aten._to_copy.out, "out",
                       ("dtype", "layout", "device", "pin_memory"))
    except AttributeError:  # pragma: no cover
        return None


@functools.lru_cache(maxsize=4096)
def out_plan(func: Any) -> OutPlan | None:
    """The ``out=`` twin of a functional ATen overload, or None when it has none.

    Only operators that return one fresh tensor qualify: not mutating, not a view (the
    return has no alias annotation), not random / data-dependent / view-copy (tags), and
    with an overload of the same packet whose arguments are the same plus one ``out``.
    """
    try:
        if func is torch.ops.aten._to_copy.default:  # .float(), .to(dtype): out= has no dtype
            return _to_copy_plan()
        schema = func._schema
        if schema.is_mutable or len(schema.returns) != 1:
            return None
        ret = schema.returns[0]
        if ret.alias_info is not None or str(ret.type) != "Tensor":
            return None
        if any(t in _SKIP_TAGS for t in getattr(func, "tags", ())):
            return None
        args = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
        packet = func.overloadpacket
        for name in packet.overloads():
            ov = getattr(packet, name)
            outs = [a for a in ov._schema.arguments if a.is_out]
            rest = [(a.name, str(a.type), a.kwarg_only) for a in ov._schema.arguments
                    if not a.is_out]
            if len(outs) == 1 and rest == args and len(ov._schema.returns) == 1 and \
                    str(outs[0].type) == "Tensor":
                return OutPlan(ov, outs[0].name)
    except (AttributeError, RuntimeError):
        return None
    return None


def _flat(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat(y)
    else:
        yield x


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(y) for y in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


if _Mode is not None:

    class PooledOutputs(_Mode):
        """While active on a thread, large fresh op outputs come from ``alloc``.

        Args:
            alloc: ``alloc(shape, dtype)`` returning a contiguous CPU tensor (the native
                ``alloc_result``: pooled, pre-faulted, recycled when the last tensor over
                it dies).
            min_bytes: Smaller outputs are left to torch's allocator.

        Attributes:
            pooled: Outputs served from ``alloc``.
            pooled_bytes: Their bytes.
            fallbacks: Calls that ran unchanged after the pooled form could not be used.
            native_gathers: Token-dropping gathers run by the core (``batch/_gather.py``).
        """

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Nothing here is compiled: without this, the first dispatch imports
            # torch._dynamo (a slow import of hundreds of modules).
            return False

        def __init__(self, alloc: AllocFn, min_bytes: int = MIN_POOLED_BYTES) -> None:
            super().__init__()
            self._alloc = alloc
            self.min_bytes = min_bytes
            self.pooled = 0
            self.pooled_bytes = 0
            self.fallbacks = 0
            self.native_gathers = 0

        def _worth_it(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            """Dense CPU tensors only, and a large one among them (or none: a factory)."""
            big = False
            seen = False
            for x in _flat((args, kwargs)):
                if isinstance(x, torch.Tensor):
                    seen = True
                    if type(x) is not torch.Tensor:  # subclasses keep their own semantics
                        return False
                    if x.device.type != "cpu" or x.layout != torch.strided or x.requires_grad \
                            or x.is_conj() or x.is_neg() or x.is_quantized:
                        return False
                    big = big or x.numel() * x.element_size() >= self.min_bytes
            return big or not seen

        def _gathered(self, gather: Gather) -> torch.Tensor | None:
            """A token-dropping gather run on the core into a pooled output, or None."""
            numel = 1
            for n in gather.shape:
                numel *= n
            if numel * gather.dtype.itemsize < self.min_bytes:
                return None
            out = self._alloc(gather.shape, gather.dtype)
            if not gather.run(out):
                return None
            self.pooled += 1
            self.native_gathers += 1
            self.pooled_bytes += out.numel() * out.element_size()
            return out

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            if func in GATHER_OPS and self._worth_it(args, kwargs):
                gather = gather_call(func, args, kwargs)
                done = self._gathered(gather) if gather is not None else None
                if done is not None:
                    return done
            plan = out_plan(func)
            if plan is None or plan.out_name in kwargs or not plan.accepts(kwargs) or \
                    not self._worth_it(args, kwargs):
                return func(*args, **kwargs)
            known = fast_out_meta(func, args, kwargs)  # no meta kernel: see batch/_shapes.py
            if known is None:
                try:
                    meta = func(*_to_meta(args), **_to_meta(kwargs))
                except Exception:  # no meta kernel, data-dependent, or a genuine error
                    return func(*args, **kwargs)  # the plain call raises genuine errors
                if not isinstance(meta, torch.Tensor) or meta.device.type != "meta" or \
                        meta.layout != torch.strided or not meta.is_contiguous() or \
                        meta.is_quantized:
                    return func(*args, **kwargs)
                known = (tuple(meta.shape), meta.dtype)
            shape, dtype = known
            numel = 1
            for n in shape:
                numel *= n
            if numel * dtype.itemsize < self.min_bytes:
                return func(*args, **kwargs)
            out = self._alloc(shape, dtype)
            try:
                res = plan.call(args, kwargs, out)
            except Exception:
                self.fallbacks += 1
                return func(*args, **kwargs)
            if (res is not out and (not isinstance(res, torch.Tensor)
                                    or res.data_ptr() != out.data_ptr())) or \
                    tuple(res.shape) != shape or res.dtype != dtype:
                self.fallbacks += 1  # an out= form that did not write into out: be plain
                return func(*args, **kwargs)
            self.pooled += 1
            self.pooled_bytes += out.numel() * out.element_size()
            return out

else:  # pragma: no cover
    PooledOutputs = None  # type: ignore[assignment,misc]


# ------------------------------------------------------------------------------ threads
_GOMP: Any = None
_GOMP_LOCK = threading.Lock()


def _libgomp() -> Any:
    """The OpenMP runtime torch loaded (GNU libgomp), or None."""
    global _GOMP
    with _GOMP_LOCK:
        if _GOMP is None:
            _GOMP = False
            try:
                with open("/proc/self/maps") as f:
                    paths = sorted({ln.split()[-1] for ln in f
                                    if "libgomp" in ln.split()[-1] and ".so" in ln.split()[-1]})
                for p in paths:
                    lib = ctypes.CDLL(p, mode=os.RTLD_NOLOAD)
                    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                    lib.omp_get_max_threads.restype = ctypes.c_int
                    _GOMP = lib
                    break
            except (OSError, AttributeError) as err:
                logger.debug("no libgomp handle: %s", err)
        return _GOMP or None


def set_thread_intraop_threads(n: int) -> bool:
    """Set the calling thread's torch intra-op (OpenMP) thread count; True when done.

    Only the calling thread's OpenMP ICV changes (``omp_set_num_threads``), unlike
    ``torch.set_num_threads``, which also changes the default of threads started later.
    """
    torch.get_num_threads()  # torch's per-thread lazy init first (it would override us)
    lib = _libgomp()
    if lib is None:
        return False
    lib.omp_set_num_threads(int(n))
    return torch.get_num_threads() == n


# ------------------------------------------------------------------------------ policy
def _env_flag(name: str) -> bool | None:
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return None
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise InvalidArgumentError(f"{name}={v!r}: expected 0/1, true/false, on/off")


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise InvalidArgumentError(f"{name}={v!r}: expected a positive integer")
    return int(v)


def default_edit_threads(cores: int, caller_threads: int) -> int:
    """Intra-op threads for the edit: the caller's torch count, at most the usable cores.

    Up to the usable cores, more threads made the edit faster even beside its neighbours'
    copies (docs/performance.md); beyond them they would only oversubscribe.
    """
    return max(1, min(caller_threads, cores))


@dataclass(frozen=True)
class EditPolicy:
    """How a batch runs ``fn``.

    Attributes:
        pool_outputs: Serve large op outputs from the warm result pool
            (:class:`PooledOutputs`).
        threads: Intra-op threads of the edit thread (None: leave torch's default).

    """

    pool_outputs: bool = True
    threads: int | None = None

    @classmethod
    def resolve(cls, pool_outputs: bool | None, edit_threads: int | None, *, cores: int,
                caller_threads: int, native: bool) -> EditPolicy:
        """Arguments first, then the environment, then the defaults.

        Raises:
            InvalidArgumentError: A bad argument or environment value.
        """
        if pool_outputs is not None and not isinstance(pool_outputs, bool):
            raise InvalidArgumentError(f"pool_outputs must be a bool or None, got {pool_outputs!r}")
        if edit_threads is not None and (type(edit_threads) is not int or edit_threads < 1):
            raise InvalidArgumentError(
                f"edit_threads must be a positive int or None, got {edit_threads!r}")
        pool = pool_outputs if pool_outputs is not None else _env_flag(ENV_POOL_OUTPUTS)
        threads = edit_threads if edit_threads is not None else _env_int(ENV_EDIT_THREADS)
        if threads is None:
            threads = default_edit_threads(cores, caller_threads)
        return cls(pool_outputs=(pool is not False) and native and PooledOutputs is not None,
                   threads=threads)


class EditRunner:
    """Runs edits on the thread it is used from, under an :class:`EditPolicy`.

    Call :meth:`setup` once on that thread, then :meth:`call` per item.

    Args:
        policy: The policy.
        alloc: Allocator for pooled outputs (``alloc_result`` of the native backend).
        grad_enabled: The caller's grad mode (applied around every call).
        inference_mode: Whether the caller was in ``torch.inference_mode``.
    """

    def __init__(self, policy: EditPolicy, alloc: AllocFn | None, *, grad_enabled: bool,
                 inference_mode: bool) -> None:
        self.policy = policy
        self._alloc = alloc
        self._grad = grad_enabled
        self._inference = inference_mode
        self.mode: Any = None
        self.threads_set = False

    def setup(self) -> None:
        """Apply the thread policy to the calling thread."""
        if self.policy.threads is not None:
            self.threads_set = set_thread_intraop_threads(self.policy.threads)
        if self.policy.pool_outputs and self._alloc is not None and PooledOutputs is not None:
            self.mode = PooledOutputs(self._alloc)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under the caller's grad mode and the output pool.

        A pooled output cannot grow (its storage is not resizable): an edit that resizes
        one beyond its size raises; it is then run again without the pool, which stays
        off for the rest of the batch (logged once).
        """
        mode = self.mode
        try:
            return self._call(fn, mode, args, kwargs)
        except RuntimeError as err:
            if mode is None or "not resizable" not in str(err):
                raise
            logger.warning("an edit resized a pooled output (%s); running it again without "
                           "pooled outputs, which stay off for this batch", err)
            self.mode = None
            return self._call(fn, None, args, kwargs)

    def _call(self, fn: Callable[..., Any], mode: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        with contextlib.ExitStack() as st:
            if self._inference:
                st.enter_context(torch.inference_mode())
            else:
                st.enter_context(torch.set_grad_enabled(self._grad))
            if mode is not None:
                st.enter_context(mode)
            return fn(*args, **kwargs)
