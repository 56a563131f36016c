#!/usr/bin/env bash
# Create .venv and install everything: torch (CPU, local file), the real LMCache 0.5.6
# server's CPU runtime, build/test tools, and this project (its C++ core compiled in place).
# Idempotent: a second run only rebuilds the project.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() { "$VENV/bin/pip" install -q "$@" 2>&1 | grep -v -E "is ignored|^$" || true; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.lmckvf-deps-$(cat requirements/*.txt scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch==2.13.0 (CPU), lmcache==0.5.6 server runtime, dev tools"
  pipq torch==2.13.0
  "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  pipq --no-deps lmcache==0.5.6
  pipq -r requirements/server-cpu.txt
  pipq -r requirements/dev.txt
  "$VENV/bin/python" -c "import lmcache.lmcache_native, lmcache.sdk.kvcache, lmcache.v1.multiprocess.http_server" \
    >/dev/null 2>&1 || { echo "[setup] lmcache server import check failed" >&2; exit 1; }
  rm -f "$VENV"/.lmckvf-deps-*
  touch "$stamp"
fi
echo "[setup] building lmcache-kv-fast (C++ core in place)"
"$VENV/bin/pip" install -q --no-build-isolation --no-deps \
  -Ceditable.mode=inplace -Cbuild-dir=build/inplace -e . 2>&1 | grep -v -E "is ignored" || true
"$VENV/bin/python" -c "import lmcache_kv_fast as m; print('[setup] lmcache_kv_fast', m.__version__, 'backend', m.backend())"
