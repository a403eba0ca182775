#!/bin/bash
# Device call 3 of issue #26 (nvidia-h200), from the repo root, carry [".whl"]: the sort-free draw
# (kvtransfer/kernels/triton_sample.py).
# 1. the sampler's and the kernels' gpu tests (the Triton draw == the torch reference at vocab 152,064; captured ==
#    eager; a graphed engine step with sampling rows == eager), the engine's;
# 2. the decode step, greedy vs every row sampling at temperature 1, top_p 0.9: `kvtransfer-bench decode`, same
#    cells as call 1, alternating greedy, sampling, greedy, sampling;
# 3. guidellm again through kvtransfer-api (it samples at temperature 1, OpenAI's default), as in serve.sh.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/stocksite .whl/stock/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r3
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py tests/test_engine_gpu.py \
  -s > $OUT/r3/gpu-tests.log 2>&1
echo "gpu tests rc $?: $(tail -1 $OUT/r3/gpu-tests.log)"
for round in 1 2; do
  for arm in greedy sampling; do
    flags=$([ $arm = sampling ] && echo "--temperature 1 --top-p 0.9" || echo "")
    timeout 150 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 \
      --hf none $flags --out $OUT/r3/decode-$arm-$round > $OUT/r3/decode-$arm-$round.log 2>&1
    echo "$arm-$round rc $?: $(grep 'engine ' $OUT/r3/decode-$arm-$round.log | sed 's/decode: engine //' | grep -v '━' | tr '\n' ' ')"
    tar -C $OUT -czf $OUT/call3.tgz r3
  done
done
python3 bench/results/openai-h200-2026-12-02/summarize_decode.py $OUT/r3
python3 -m bench.stock.tokenizer --model qwen2.5-7b --out /tmp/qwen-words > /dev/null
python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 > $OUT/r3/decode.log 2>&1 & dpid=$!
python3 -m api_server --backend 127.0.0.1:50051 --listen 127.0.0.1:8000 --tokenizer /tmp/qwen-words \
  > $OUT/r3/api.log 2>&1 & apid=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=300)"
for i in $(seq 60); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 2; done
timeout 200 bash bench/stock/run_stock.sh --site /tmp/stocksite --target http://127.0.0.1:8000 --model qwen2.5-7b \
  --tokenizer /tmp/qwen-words --out $OUT/r3/guidellm > $OUT/r3/guidellm.log 2>&1
echo "guidellm rc $?: $(python3 -c "import json; s=json.load(open('$OUT/r3/guidellm/summary.json')); print(s['requests'], s['output_tokens_per_s'], s['ttft_ms']['p50'], s['itl_ms']['p50'])" 2>&1)"
rm -f $OUT/r3/guidellm/prompts.jsonl; gzip -9 $OUT/r3/guidellm/benchmarks.json
kill -TERM $apid $dpid; wait $apid $dpid; echo "servers exited $?"
tar -C $OUT -czf $OUT/call3.tgz r3 && rm -rf $OUT/r3
