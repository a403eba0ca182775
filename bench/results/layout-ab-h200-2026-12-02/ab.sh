#!/bin/bash
# The layout restructure's A/B (issue #25) in one device call (nvidia-h200): the tree before it (a8650d6, unpacked
# under _ab/before by `git archive`, carried) against the tree after it (the repo root), the same commands each:
# - decode step time: `kvtransfer-bench decode` over batch 1, 32, 64 x context 1024, 8192 (p50 of 20 after 3
#   warm-up steps, the floor measured in the same run beside it);
# - serve throughput: a colocated server with default flags, the README serve workload cut to 512 prompts
#   (input 1024 +-50%, output 128, concurrency 32, seed 0: the same prompts in both arms).
# Order: before, after, before, after for the serve arm (two rounds: drift shows as a gap between rounds).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
tree() { [ "$1" = before ] && echo _ab/before || echo .; }
decode_arm() {  # NAME
  (cd "$(tree $1)" && PYTHONPATH=/tmp/site:. timeout 150 python3 -m bench.cli decode --model qwen2.5-7b \
     --batches 1,32,64 --contexts 1024,8192 --hf none --out $OUT/r/decode-$1) > $OUT/r/decode-$1.log 2>&1
  echo "decode-$1: rc $?"; tail -1 $OUT/r/decode-$1.log | cut -c1-300
}
serve_arm() {  # NAME ROUND
  local d=127.0.0.1:$(port) name=serve-$1-$2
  (cd "$(tree $1)" && PYTHONPATH=/tmp/site:. exec python3 -m decode_server --colocated --model qwen2.5-7b \
     --listen $d) > $OUT/r/$name.decode.log 2>&1 &
  local pid=$!
  (cd "$(tree $1)" && PYTHONPATH=/tmp/site:. python3 -c "
import sys
from bench.launch import wait_serving
wait_serving(sys.argv[1], [], timeout=200)" $d 2>/dev/null || PYTHONPATH=/tmp/site:. python3 -c "
import sys
from bench.measure.launch import wait_serving
wait_serving(sys.argv[1], [], timeout=200)" $d) || echo "$name: never SERVING"
  (cd "$(tree $1)" && PYTHONPATH=/tmp/site:. timeout 200 python3 -m bench.cli serve --addr $d --model qwen2.5-7b \
     --num-prompts 512 --concurrency 32 --input-len 1024 --input-len-range 0.5 --output-len 128 --warmup 4 \
     --timeout 300 --out $OUT/r/$name) > $OUT/r/$name.bench.log 2>&1
  tail -1 $OUT/r/$name.bench.log | cut -c1-400
  kill -TERM $pid; wait $pid; echo "$name: server exited $?"
}
save() { tar -C $OUT -czf $OUT/ab.tgz r; }  # after every arm: a call cut short still brings back what ran
decode_arm before; save
decode_arm after; save
serve_arm before 1; save
serve_arm after 1; save
serve_arm before 2; save
serve_arm after 2; save
rm -rf $OUT/r
