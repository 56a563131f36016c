"""``python -m lmcache_kv_fast.testing.bench`` is ``lmcache-kv-fast bench``."""

import sys

from lmcache_kv_fast.testing.bench.cli import main

sys.exit(main(sys.argv[1:]))
