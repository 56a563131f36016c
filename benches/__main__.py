"""``python -m benches`` is ``lmcache-kv-fast bench`` from a checkout."""

import sys

from benches.harness.cli import main

sys.exit(main(sys.argv[1:]))
