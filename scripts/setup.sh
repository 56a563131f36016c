#!/usr/bin/env bash
# Create .venv and install everything: torch (CPU, local file), the real LMCache 0.5.6
# server's CPU runtime, build/test tools, and this project (its C++ core compiled in place).
# Idempotent: a second run only rebuilds the project.
#
# Quiet when it works, loud when it does not: a failed step stops the script (set -e) and
# shows what pip printed. Order matters for the quiet part:
#   1. torch, the server's CPU runtime and the dev tools in one resolver run;
#   2. the torch check, after numpy is installed (torch warns when it finds no numpy);
#   3. lmcache itself LAST and with --no-deps: its declared dependencies are CUDA-heavy
#      and the CPU server does not need them. Any pip install that resolves dependencies
#      after it would report them as missing ("pip's dependency resolver ..."), so nothing
#      does: the project below is installed with --no-deps too, and when the requirements
#      change in an existing venv, lmcache is uninstalled before step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Lines a successful install may print that need no action, as whole-line patterns:
# blank lines, and pip's note that a configured local index directory (a file:// URL in a
# pip.conf) has no entry for a package.
HARMLESS="^[[:space:]]*\$|^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.\$"

# pip install -q, showing everything it prints except the HARMLESS lines; when pip fails,
# the script stops with pip's exit status.
pipq() {
  local out rc=0
  out=$("$VENV/bin/pip" install -q "$@" 2>&1) || rc=$?
  if [ -n "$out" ]; then
    printf '%s\n' "$out" | grep -v -E "$HARMLESS" >&2 || true  # grep: 1 = nothing left
  fi
  if [ "$rc" -ne 0 ]; then
    echo "[setup] failed (exit $rc): pip install $*" >&2
    exit "$rc"
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.lmckvf-deps-$(cat requirements/*.txt scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch==2.13.0 (CPU), lmcache==0.5.6 server runtime, dev tools"
  # An existing venv (requirements changed): take lmcache out first, so that installing a
  # package it depends on does not make pip list lmcache's missing CUDA dependencies.
  if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('lmcache')" 2>/dev/null; then
    "$VENV/bin/pip" uninstall -q -y lmcache
  fi
  pipq torch==2.13.0 -r requirements/server-cpu.txt -r requirements/dev.txt
  "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  pipq --no-deps lmcache==0.5.6
  if ! err=$("$VENV/bin/python" -c \
      "import lmcache.lmcache_native, lmcache.sdk.kvcache, lmcache.v1.multiprocess.http_server" 2>&1); then
    printf '%s\n' "$err" >&2
    echo "[setup] lmcache server import check failed" >&2
    exit 1
  fi
  rm -f "$VENV"/.lmckvf-deps-*
  touch "$stamp"
fi
echo "[setup] building lmcache-kv-fast (C++ core in place)"
pipq --no-build-isolation --no-deps -Ceditable.mode=inplace -Cbuild-dir=build/inplace -e .
"$VENV/bin/python" -c "import lmcache_kv_fast as m; print('[setup] lmcache_kv_fast', m.__version__, 'backend', m.backend())"
