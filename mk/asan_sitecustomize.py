"""Copied into the ASan stage as ``sitecustomize.py`` (see mk/asan.mk).

The venv's editable install puts a meta-path finder ahead of ``sys.path`` that maps
``lmcache_kv_fast`` to the source tree (and its unsanitized ``_native``); drop it so the
staged copy with the sanitized extension is imported.
"""

import sys

sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(type(f), "__module__", "").startswith("_editable")]
