#!/bin/bash
# One arm of #27's acceptance: start the server(s) with the flags given, wait until SERVING, run the multi-turn
# load (64 conversations x 6 turns, first prompt 2,048 tokens, 256 new user tokens and 128 answer tokens a turn,
# concurrency 32; reuse off, then on, in one `kvtransfer-bench serve --multi-turn` run), keep the decode server's
# /metrics after it, stop the servers (SIGTERM). Usage: mt_arm.sh NAME colocated|pair "DECODE FLAGS" ["PREFILL FLAGS"]
# From the repo root on the device, with PYTHONPATH set; $OUT from the device tool.
set -u
name=$1 kind=$2 dflags=$3 pflags=${4:-}
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
d=127.0.0.1:$(port) p=127.0.0.1:$(port) m=$(port)
pids=()
if [ "$kind" = pair ]; then
  python3 -m prefill_server --model qwen2.5-7b --listen $p $pflags > $OUT/r/$name.prefill.log 2>&1 & pids+=($!)
  python3 -m decode_server --model qwen2.5-7b --listen $d --prefill-addr $p --metrics-port $m $dflags \
    > $OUT/r/$name.decode.log 2>&1 & pids+=($!)
else
  python3 -m decode_server --colocated --model qwen2.5-7b --listen $d --metrics-port $m $dflags \
    > $OUT/r/$name.decode.log 2>&1 & pids+=($!)
fi
t0=$(date +%s)
python3 -c "from bench.measure.launch import wait_serving; wait_serving('$d', [], timeout=200)" \
  || { echo "$name: never SERVING"; tail -20 $OUT/r/$name.*.log; }
echo "$name: SERVING after $(( $(date +%s) - t0 )) s; $(grep -h 'engine defaults\|prefix cache:' $OUT/r/$name.decode.log | sed 's/.*INFO //' | tr '\n' ' ')"
timeout 300 python3 -m bench.cli serve --multi-turn --addr $d --model qwen2.5-7b --num-prompts 64 --turns 6 \
  --input-len 2048 --user-len 256 --output-len 128 --concurrency 32 --warmup 2 --timeout 300 --out $OUT/r/$name \
  > $OUT/r/$name.bench.log 2>&1
echo "$name: bench rc $?"
python3 - $OUT/r/$name/result.json <<'PY' || tail -5 $OUT/r/$name.bench.log
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps(r.get("headline", r), indent=None)[:900])
PY
curl -s http://127.0.0.1:$m/metrics | grep -E "^kvt_(prefix|kv_pool|requests_total)" > $OUT/r/$name.metrics.txt
grep -E "prefix_hits|host_decisions|reload_bytes_total|cached_slots|host_bytes" $OUT/r/$name.metrics.txt | tr '\n' ' '; echo
kill -TERM "${pids[@]}"; wait "${pids[@]}"; echo "$name: servers exited $?"
