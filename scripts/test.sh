#!/usr/bin/env bash
# The whole test suite: sets everything up, then runs pytest against real LMCache servers
# (SHM and pickle planes), with the native backend, again with the torch backend, and the
# core integration tests a third time against an LMCache 0.5.7rc2 server (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# benches/ and testbed/ (the checkout's, not the wheel's) import from the checkout root
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The three venvs are independent: the engine's and 0.5.7rc2's are built in the background
# while .venv is set up (mostly downloads and unpacking; ~3 min saved on a fresh machine).
#   .venv-engine: the vLLM CPU engine for tests/engine (cached after the first run)
#   .venv-compat/0.5.7rc2: its compat-matrix rows run in the native pass, its server in the last
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT
./scripts/engine-venv.sh >"$logs/engine-venv" 2>&1 & engine_pid=$!
./scripts/compat-venvs.sh 0.5.7rc2 >"$logs/compat-venvs" 2>&1 & compat_pid=$!
./scripts/setup.sh
# wait_setup PID NAME: what the background script printed, and its failure stops the run
wait_setup() {
  local rc=0
  wait "$1" || rc=$?
  cat "$logs/$2"
  if [ "$rc" -ne 0 ]; then echo "[test] scripts/$2.sh failed (exit $rc)" >&2; exit "$rc"; fi
}
wait_setup "$engine_pid" engine-venv
wait_setup "$compat_pid" compat-venvs
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 RAY_USAGE_STATS_ENABLED=0 \
  RAY_DATA_USAGE_DISABLED=1
# two xdist workers: much of the suite waits on servers, engines and heartbeats; the shared
# engines' tests run on one worker and the Ray cluster's on one (tests/conftest.py)
PYTEST=".venv/bin/python -m pytest -n 2 --dist loadgroup"
echo "[test] ruff"; .venv/bin/ruff check lmcache_kv_fast tests benches examples testbed
echo "[test] native backend"
$PYTEST -q -m "not compat" -p no:cacheprovider "$@"
echo "[test] torch backend (the core integration tests again, forced fallback backend)"
LMCACHE_KV_FAST_BACKEND=torch $PYTEST -q -m "not compat" -p no:cacheprovider \
  tests/integration/test_roundtrip.py tests/integration/test_interop.py \
  tests/integration/test_beyond.py tests/integration/test_read_hints.py \
  tests/integration/test_fused_rewrite.py \
  -k "not heartbeat and not stress and not l1_full" "$@"
echo "[test] LMCache 0.5.7rc2 server (core integration, sdk and engine tests again, LMCACHE_KV_FAST_TEST_SERVER)"
# The engine runs 0.5.7rc2's LMCacheMPConnector (scripts/engine-venv.sh) against that server; the
# edit proofs on the engine (test_engine_edits.py, two extra engines) run in the native pass only.
LMCACHE_KV_FAST_TEST_SERVER=0.5.7rc2 $PYTEST -q -m "not compat" -p no:cacheprovider \
  tests/integration/test_roundtrip.py tests/integration/test_interop.py \
  tests/integration/test_read_hints.py tests/integration/test_batch.py \
  tests/integration/test_fused_rewrite.py tests/integration/test_events.py tests/sdk/test_sdk_server.py \
  tests/sdk/test_sdk_fused.py tests/integration/test_snapkv_qcache.py \
  tests/distributed/test_fleet_grpc.py tests/engine tests/sdk/test_sdk_engine.py \
  --ignore=tests/engine/test_engine_edits.py -k "not heartbeat and not stress" "$@"
