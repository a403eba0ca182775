#!/bin/bash
# make gpu-test on the restructured tree (issue #25), nvidia-h200, from the repo root, carry [".whl"].
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
git log --oneline -1 2>/dev/null
timeout 570 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs > $OUT/gpu-tests.log 2>&1
echo "pytest rc $?"; tail -15 $OUT/gpu-tests.log
