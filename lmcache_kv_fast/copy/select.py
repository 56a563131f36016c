"""Backend selection (the pyzmq pattern).

``native`` unless ``LMCACHE_KV_FAST_BACKEND=torch``; if the native module fails to import,
fall back to ``torch`` with one warning (an explicit ``=native`` then raises instead).
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from types import ModuleType

logger = logging.getLogger(__name__)

ENV_BACKEND = "LMCACHE_KV_FAST_BACKEND"
_BACKENDS: dict[str, ModuleType] = {}
_default: ModuleType | None = None


def get_backend(name: str) -> ModuleType:
    """Import and return the backend module ``name`` (``"native"`` or ``"torch"``).

    Raises:
        ValueError: Unknown name.
        ImportError: The native extension is not available.
    """
    if name not in ("native", "torch"):
        raise ValueError(f"unknown copy backend {name!r}; expected 'native' or 'torch'")
    mod = _BACKENDS.get(name)
    if mod is None:
        mod = importlib.import_module(f"lmcache_kv_fast.copy.{name}_backend")
        _BACKENDS[name] = mod
    return mod


def backend() -> ModuleType:
    """Return the live backend module (chosen once per process)."""
    global _default
    if _default is not None:
        return _default
    want = os.environ.get(ENV_BACKEND, "").strip().lower()
    if want and want not in ("native", "torch"):
        raise ValueError(f"{ENV_BACKEND}={want!r}: expected 'native' or 'torch'")
    if want == "torch":
        _default = get_backend("torch")
        return _default
    try:
        _default = get_backend("native")
    except ImportError as err:
        if want == "native":
            raise
        warnings.warn(
            f"lmcache_kv_fast native core unavailable ({err}); using the torch backend",
            RuntimeWarning,
            stacklevel=2,
        )
        _default = get_backend("torch")
    return _default


def backend_name() -> str:
    """Return ``"native"`` or ``"torch"``: which backend is live."""
    return backend().NAME


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
