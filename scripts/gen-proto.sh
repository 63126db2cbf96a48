#!/usr/bin/env bash
# Regenerates the Python protobuf/gRPC code from proto/. Never hand-edit memsnap/v1 or memsnap/criurpc.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/memsnap/v1/memsnap.proto proto/memsnap/v1/peer.proto
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" proto/memsnap/criurpc/criu_rpc.proto proto/memsnap/criurpc/criu_stats.proto
python -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/memsnap/criapi/cri_api.proto
touch "$out/memsnap/v1/__init__.py" "$out/memsnap/criurpc/__init__.py" "$out/memsnap/criapi/__init__.py"
