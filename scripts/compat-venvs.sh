#!/usr/bin/env bash
# Create (or reuse) one venv per old LMCache MP server version for the compatibility matrix
# (tests/compat, `make test-compat`, docs/protocol.md Appendix C):
#
#   .venv-compat/<ver>   python3 -m venv; torch==2.13.0 (CPU, local wheel);
#                        lmcache==<ver> --no-deps; the CPU server runtime pins of
#                        requirements/server-cpu.txt; for 0.5.6 and later also the gRPC
#                        transport's packages (grpcio==1.78.0, protobuf 6: `--transport grpc`
#                        dies on a missing `grpc` module); smoke import of the server and SDK.
#
# Usage: scripts/compat-venvs.sh [VERSION ...]
#        (default: 0.5.1 0.5.2 0.5.3 0.5.4 0.5.5 0.5.7rc2; release candidates such as 0.5.7rc2
#        are accepted)
# 0.5.6 is the main .venv's server (scripts/setup.sh); pass 0.5.6 to get a separate one.
# Idempotent: a venv whose stamp file matches RECIPE and the pins is left alone (a broken or
# half-built one is rebuilt). LMCACHE_COMPAT_VENVS overrides the directory (tests read it too).
# Every lmcache 0.5.1 .. 0.5.6 release has a cp311-cp311-manylinux_2_27/2_28_x86_64 wheel on
# PyPI, so nothing is built from source.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${LMCACHE_COMPAT_VENVS:-.venv-compat}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.5.1 0.5.2 0.5.3 0.5.4 0.5.5 0.5.7rc2)

pins=requirements/server-cpu.txt
# Bump RECIPE when the install steps below change: every venv is then rebuilt.
RECIPE=2
# gRPC transport of 0.5.6+ (0.5.7rc2's generated code pins GRPC_GENERATED_VERSION 1.78.0 and
# protobuf gencode 6.31.1; protobuf as in requirements/dev.txt)
grpc_pins=(grpcio==1.78.0 protobuf==6.33.6)
digest=$( (echo "recipe $RECIPE ${grpc_pins[*]}"; cat "$pins") | sha1sum | cut -c1-12)
smoke='import torch, lmcache, lmcache.v1.multiprocess.http_server, lmcache.sdk.kvcache'

for ver in "${versions[@]}"; do
  if ! [[ $ver =~ ^0\.5\.[0-9]+(rc[0-9]+)?$ ]]; then
    echo "[compat] not a 0.5.x version: $ver" >&2; exit 2
  fi
  venv="$ROOT/$ver"
  stamp="$venv/.lmckvf-compat-$digest"
  if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
    echo "[compat] $venv ready (cached)"
    continue
  fi
  echo "[compat] creating $venv (torch 2.13.0 CPU + lmcache==$ver --no-deps + server pins)"
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$ROOT"
  "$PY" -m venv "$venv"
  pipq() {  # quiet; hide the resolver's complaints about lmcache's skipped CUDA deps
    local out rc=0
    out=$("$venv/bin/python" -m pip install -q "$@" 2>&1) || rc=$?
    printf '%s\n' "$out" | grep -v -E "^lmcache .* requires |dependency conflicts|is ignored|^$" || true
    return "$rc"
  }
  pipq torch==2.13.0
  pipq --no-deps "lmcache==$ver"
  pipq -r "$pins"
  smoke_ver=$smoke
  if [[ ! $ver =~ ^0\.5\.[1-5](rc[0-9]+)?$ ]]; then  # 0.5.6 and later
    pipq "${grpc_pins[@]}"
    smoke_ver="$smoke, grpc, google.protobuf"
  fi
  if ! LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
      "$venv/bin/python" -c "$smoke_ver" >"$venv/smoke.log" 2>&1; then
    echo "[compat] smoke import failed for lmcache==$ver:" >&2
    tail -20 "$venv/smoke.log" >&2
    exit 1
  fi
  got=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("lmcache"))')
  if [ "$got" != "$ver" ]; then
    echo "[compat] $venv has lmcache $got, expected $ver" >&2; exit 1
  fi
  rm -f "$venv"/.lmckvf-compat-*
  touch "$stamp"
  echo "[compat] $venv ready in $(( $(date +%s) - start ))s"
done
