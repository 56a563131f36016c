"""``python -m lmcache_kv_fast`` is the ``lmcache-kv-fast`` command."""

import sys

from lmcache_kv_fast.cli import main

sys.exit(main())
