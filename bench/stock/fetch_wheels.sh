#!/usr/bin/env bash
# Download the wheels of gpu-wheels.txt for the GPU machine (CPython 3.12, manylinux x86_64, no network there)
# into DIR (default .whl/stock, which .gitignore's /.whl/ already ignores). Run where pip reaches PyPI.
#   bench/stock/fetch_wheels.sh [DIR] [PYTHON_VERSION]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${1:-.whl/stock}" pyver="${2:-3.12}"
mkdir -p "$dir"
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_5_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  plats+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${plats[@]}" -d "$dir" -r <(grep -v '^#' "$here/gpu-wheels.txt")
ls -l "$dir"/*.whl | awk '{n++; s+=$5} END {printf "%d wheels, %.1f MiB\n", n, s/1048576}'
