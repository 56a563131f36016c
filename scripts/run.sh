#!/usr/bin/env bash
# The main job: set everything up, start a local real LMCache server, run the token-dropping
# demo and the copy-path benchmark (quick), printing what they did.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1
echo "[run] demo: token dropping against a local real LMCache server"
.venv/bin/python examples/e2e_kv_edit.py --local
if .venv/bin/python -c "import lmcache_kv_fast.cli" 2>/dev/null; then
  echo "[run] benchmark (quick)"
  .venv/bin/lmcache-kv-fast bench --quick "$@"
fi
