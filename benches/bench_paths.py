"""Every copy path against real LMCache servers: ``python benches/bench_paths.py [flags]``.

A thin wrapper of :mod:`benches.harness` (the same harness as
``lmcache-kv-fast bench``); ``--help`` lists the flags, ``--quick`` is the CI-sized run.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benches.harness.cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
