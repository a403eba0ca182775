#!/bin/bash
# One-GPU call for issue #39 (the step's token budget), ~5 min (its timeouts add up to 580 s): every figure its
# acceptance asks for, in one call.
# Preamble, carry and $OUT as in two-gpu-1-smoke.sh; any one-GPU kind.
#  1. the decode step at batch 64 and 128 over 1k (ITL p50 is judged against 1.5x it), CUDA graphs, memory floor;
#  2. the attention probe (the side stream, the decode kernel's launches alone and beside the chunk kernel, the
#     pair's variants: --pair-sweep), the decode kernel's split counts at 8-256 rows (choose_num_splits' rule), and the
#     512-row mixed step's profile (64 decode rows at 1k + 448 prompt rows);
#  3. the README serve workload at c64 and c128 against a colocated server with default flags, with serve's
#     roofline (the GEMM rate measured in the run).
set -u
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
timeout -k 10 80 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 20 --warmup 3 --out "$OUT/decode" > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep -E "^\| (64|128) " "$OUT/decode/report.md" 2>/dev/null | head -4
timeout -k 10 60 python3 -m bench.probes.chunk_attention --decode-sweep --pair-sweep --no-chunk-sweep --cases 448@512 \
    > "$OUT/probe-attention.log" 2>&1
echo "attention probe rc=$?"; grep -E "^(pair|pairs|decode) " "$OUT/probe-attention.log" | cut -c1-200 | head -36
timeout -k 10 60 python3 -m bench.probes.chunk_attention \
    --split-sweep 8@4096,16@1024,32@1024,64@1024,128@1024,256@1024,64@4096,32@8192 > "$OUT/probe-splits.log" 2>&1
echo "split probe rc=$?"; grep -E "^splits" "$OUT/probe-splits.log" | cut -c1-160 | head -80
timeout -k 10 80 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
    > "$OUT/profile-mixed.log" 2>&1
echo "profile rc=$?"; grep -E "^(step|kernels)" "$OUT/profile-mixed.log" | head -2
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
   > "$OUT/decode-server.log" 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=150)"
echo "server rc=$?"
timeout -k 10 150 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out "$OUT/serve" > "$OUT/serve.log" 2>&1
echo "serve rc=$?"; grep -E "^\| (64|128) " "$OUT/serve/report.md" 2>/dev/null | head -4
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
tar -C "$OUT" -czf "$OUT/one-gpu-39.tgz" decode probe-attention.log probe-splits.log profile-mixed.log serve serve.log \
    decode-server.log 2>/dev/null
true
