#!/usr/bin/env bash
# The whole test suite: sets everything up, then runs pytest against real LMCache servers
# (SHM and pickle planes), with the native backend and again with the torch backend.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/engine-venv.sh  # vLLM CPU engine venv for tests/engine (cached after the first run)
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1
PYTEST=".venv/bin/python -m pytest"
echo "[test] ruff"; .venv/bin/ruff check lmcache_kv_fast tests benches examples
echo "[test] native backend"
$PYTEST -q -m "not compat" -p no:cacheprovider "$@"
echo "[test] torch backend (the core integration tests again, forced fallback backend)"
LMCACHE_KV_FAST_BACKEND=torch $PYTEST -q -m "not compat" -p no:cacheprovider \
  tests/integration/test_roundtrip.py tests/integration/test_interop.py \
  tests/integration/test_beyond.py tests/integration/test_read_hints.py \
  -k "not heartbeat and not stress and not l1_full" "$@"
