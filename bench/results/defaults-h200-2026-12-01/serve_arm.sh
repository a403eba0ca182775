#!/bin/bash
# One arm of the defaults acceptance: start the server(s) with the flags given, wait until SERVING, send the README
# serve workload (input 1024 +-50%, output 128, 1,024 prompts at concurrency 32) with `kvtransfer-bench serve`,
# stop the servers (SIGTERM), keep their logs. Usage: serve_arm.sh NAME colocated|pair "DECODE FLAGS" ["PREFILL FLAGS"]
# From the repo root on the device, with PYTHONPATH set; $OUT from the device tool.
set -u
name=$1 kind=$2 dflags=$3 pflags=${4:-}
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
d=127.0.0.1:$(port) p=127.0.0.1:$(port)
pids=()
if [ "$kind" = pair ]; then
  python3 -m prefill_server --model qwen2.5-7b --listen $p $pflags > $OUT/r/$name.prefill.log 2>&1 & pids+=($!)
  python3 -m decode_server --model qwen2.5-7b --listen $d --prefill-addr $p $dflags > $OUT/r/$name.decode.log 2>&1 & pids+=($!)
else
  python3 -m decode_server --colocated --model qwen2.5-7b --listen $d $dflags > $OUT/r/$name.decode.log 2>&1 & pids+=($!)
fi
t0=$(date +%s.%N)
python3 - "$d" <<'PY' || { echo "$name: never SERVING"; tail -20 $OUT/r/$name.*.log; }
import sys
from bench.launch import wait_serving
wait_serving(sys.argv[1], [], timeout=240)
PY
echo "$name: SERVING after $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s; $(grep -h 'engine defaults' $OUT/r/$name.decode.log | sed 's/.*INFO //')"
timeout 240 python3 -m bench.cli serve --addr $d --model qwen2.5-7b --num-prompts 1024 --concurrency 32 \
  --input-len 1024 --input-len-range 0.5 --output-len 128 --warmup 4 --timeout 600 --out $OUT/r/$name \
  > $OUT/r/$name.bench.log 2>&1
tail -1 $OUT/r/$name.bench.log | cut -c1-600
kill -TERM "${pids[@]}"; wait "${pids[@]}"; echo "$name: servers exited $?"
