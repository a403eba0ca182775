#!/bin/bash
# The small wheels the GPU machine's python3 (3.12, torch, grpcio 1.84, protobuf, no network) lacks to run the
# servers and the OpenAI front, downloaded here into .whl/ (git-ignored) to be carried to it:
#   run(carry=[".whl"]): python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# Run where pip reaches the package registry.
set -euo pipefail
dir="${1:-.whl}"
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$dir" grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  annotated-doc==0.0.7 typing-inspection==0.4.5 opentelemetry-api==1.45.2
ls "$dir"/*.whl | wc -l
