#!/bin/bash
# Call 12 (prepared, not run): the whole GPU suite (`make gpu-test`) on this tree, in two calls of at most 560 s, as
# calls 8 and 9 split it: `bash bench/results/stall-h100-2026-12-07/call12.sh a`, then `... call12.sh b` (the tests
# in rest-of-suite.txt). Carry [".whl"]. Each part's log under $OUT/call12-<part>.tgz.
set -u
part=${1:?part a or b}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call12-$part; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
rest=bench/results/stall-h100-2026-12-07/rest-of-suite.txt
if [ "$part" = a ]; then
  sel=(); while read -r id; do sel+=(--deselect "$id"); done < $rest
else
  mapfile -t sel < $rest
fi
timeout -k 5 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=20 "${sel[@]}" > $R/gpu-tests.log 2>&1
echo "gpu suite part $part rc $?"; tail -25 $R/gpu-tests.log
tar -C /tmp -czf $OUT/call12-$part.tgz call12-$part
