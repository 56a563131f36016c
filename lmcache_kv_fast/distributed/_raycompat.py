"""Import Ray on demand, with a clear error naming the extra when it is missing.

Nothing outside :mod:`lmcache_kv_fast.distributed` imports this module, so importing
``lmcache_kv_fast`` never imports Ray.
"""

from __future__ import annotations

from types import ModuleType

from lmcache_kv_fast.errors import MissingExtraError

INSTALL_HINT = "pip install 'lmcache-kv-fast[ray]'"


def require_ray() -> ModuleType:
    """Return the ``ray`` module.

    Raises:
        MissingExtraError: Ray is not installed (also an ``ImportError``).
    """
    try:
        import ray
    except ImportError as err:
        raise MissingExtraError(
            f"lmcache_kv_fast.distributed needs Ray, which is not installed: {INSTALL_HINT} "
            f"(or pip install 'ray[data]' for the Ray Data form as well)"
        ) from err
    return ray
