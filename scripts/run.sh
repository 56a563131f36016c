#!/usr/bin/env bash
# The main job: set everything up and show the real workflow.
#
#   ./scripts/run.sh               a local real LMCache server + a real vLLM CPU engine (tiny
#                                  random Llama, .venv-engine from scripts/engine-venv.sh):
#                                  the engine prefills a few prompts, the SDK drops every 10th
#                                  token of their KV, the engine decodes from the edited cache
#                                  (examples/engine_token_dropping.py: external prefix hits and
#                                  the time of each phase); then the copy-path benchmark (quick)
#   ./scripts/run.sh --no-engine   without an engine: the token-dropping demo against a local
#                                  real server, then the copy-path benchmark (quick)
# Further arguments go to the benchmark (lmcache-kv-fast bench --quick ...).
set -euo pipefail
cd "$(dirname "$0")/.."
# benches/ and testbed/ (the checkout's, not the wheel's) import from the checkout root
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
engine=1
if [ "${1:-}" = "--no-engine" ]; then
  engine=0
  shift
fi
./scripts/setup.sh
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 RAY_USAGE_STATS_ENABLED=0 \
  RAY_DATA_USAGE_DISABLED=1
if [ "$engine" = 1 ]; then
  if ! ./scripts/engine-venv.sh >/tmp/lmckvf-engine-venv.$$.log 2>&1; then
    cat /tmp/lmckvf-engine-venv.$$.log >&2
    rm -f /tmp/lmckvf-engine-venv.$$.log
    echo "[run] the engine venv could not be set up (see above); ./scripts/run.sh --no-engine" \
         "runs the demo without an engine" >&2
    exit 1
  fi
  rm -f /tmp/lmckvf-engine-venv.$$.log
  echo "[run] demo: a real vLLM engine prefills, the SDK drops tokens, the engine decodes from the edit"
  .venv/bin/python examples/engine_token_dropping.py
else
  echo "[run] demo: token dropping against a local real LMCache server"
  .venv/bin/python examples/e2e_kv_edit.py --local
fi
if .venv/bin/python -c "import lmcache_kv_fast.cli" 2>/dev/null; then
  echo "[run] benchmark (quick)"
  .venv/bin/lmcache-kv-fast bench --quick "$@"
fi
