#!/usr/bin/env bash
# Regenerate the committed gRPC descriptor sets from the .proto files of each LMCache
# generation (lmcache_kv_fast/transport/grpc_protos/v056, v057 -> v056.binpb, v057.binpb).
#
# Each .binpb is a serialized google.protobuf.FileDescriptorSet (protoc --include_imports).
# transport/grpc_codec.py loads each one into a DescriptorPool of its own at runtime, so no
# generated *_pb2 / *_pb2_grpc module exists and the two generations (same proto package
# lmcache.mp, clashing message names) never meet in protobuf's default pool.
#
# Dev-only: needs grpcio-tools (`pip install grpcio-tools==1.78.0`, protoc 31.1), e.g. in a
# throwaway --target dir: GRPC_TOOLS_PATH=/tmp/grpctools scripts/gen-grpc.sh.
# Deterministic: rerunning on unchanged .proto files gives byte-identical .binpb files
# (tests/unit/test_grpc_unit.py checks the committed ones against the .proto files).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
case "$PY" in /*) ;; */*) PY="$PWD/$PY" ;; esac
if [ -n "${GRPC_TOOLS_PATH:-}" ]; then
  export PYTHONPATH="$GRPC_TOOLS_PATH${PYTHONPATH:+:$PYTHONPATH}"
fi
DIR=lmcache_kv_fast/transport/grpc_protos
for gen in v056 v057; do
  # sorted file list: the set's order (and so its bytes) does not depend on the filesystem
  protos=$(cd "$DIR/$gen" && ls *.proto | LC_ALL=C sort)
  (cd "$DIR/$gen" && "$PY" -m grpc_tools.protoc -I. --include_imports \
     --descriptor_set_out="../$gen.binpb" $protos) || {
    echo "gen-grpc: protoc failed for $gen (is grpcio-tools installed? see the header)" >&2
    exit 1
  }
  echo "wrote $DIR/$gen.binpb ($(wc -c < "$DIR/$gen.binpb") bytes)"
done
