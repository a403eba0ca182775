#!/bin/bash
# Call 2 (the same warm machine as call 1, right after it), one GPU, carry [".whl"]: bench/runbooks/one-gpu-39-budget.sh
# without its attention probe (call 1 ran it): the decode step at 64/128 over 1k, the 512-row mixed step's profile,
# and the README serve workload at c64/c128 against a colocated server with default flags. Ran as one command line:
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
sed -e '/chunk_attention --decode-sweep/,+1d' \
    -e 's#tar -C "$OUT" -czf "$OUT/one-gpu-39.tgz" decode probe-attention.log#tar -C "$OUT" -czf "$OUT/one-gpu-39.tgz" decode#' \
    bench/runbooks/one-gpu-39-budget.sh > /tmp/rb.sh
OUT=$OUT/call2 timeout 440 bash /tmp/rb.sh
