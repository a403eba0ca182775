#!/bin/bash
# Call 7, one GPU, carry [".whl"], ~330 s: (1) the new GPU test of the staging split (the served step's device time
# before its graph's replay: input copies, and the device waiting on a host that fell behind); (2) call 6 of
# ../curve-h100-2026-12-07/ (the 512-row step alone x10, held ~20 s, then serve at c64 with the server's step times
# and now its staging share, SM clock and power logged throughout); (3) call 5 there (the graph-timed cuBLAS row
# sweep, then the roofline's measure_gemm on the hot GPU).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/call7 $OUT
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider tests/test_serve_metrics.py \
  tests/test_engine_gpu.py::test_each_graphed_steps_staging_is_a_part_of_its_device_time > /tmp/call7/pytest.log 2>&1; echo "pytest rc $?"; tail -3 /tmp/call7/pytest.log
bash bench/results/curve-h100-2026-12-07/call6.sh
grep -E "before the graphs' replays|mean step device ms|device busy" /tmp/curve6/serve/report.md /tmp/curve6/serve/c64/report.md 2>/dev/null | head -6
bash bench/results/curve-h100-2026-12-07/call5.sh
tar -C /tmp -czf $OUT/call7.tgz call7
