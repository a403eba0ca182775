#!/usr/bin/env bash
# Drive an OpenAI-compatible server (kvtransfer's api_server, vLLM, ...) with a STOCK load generator:
# guidellm 0.8.1 (vllm-project/guidellm). Fully offline: prompts of exact token counts (uniform in a range) made
# with a LOCAL tokenizer directory, fixed output length (guidellm sends max_tokens=N + ignore_eos=true), fixed
# concurrency, fixed request count. Writes guidellm's own files and a short summary.json under --out.
#
#   bench/stock/run_stock.sh --target http://127.0.0.1:8000 --model qwen2.5-7b --tokenizer /models/qwen2.5-7b \
#       --out /tmp/stock-kvt                     # the README serve workload (the defaults)
#   bench/stock/run_stock.sh --tiny --target http://127.0.0.1:8000 --tokenizer DIR --out DIR   # a CPU-sized run
#
# Anything after `--` goes to `guidellm run` as is. See bench/stock/README.md for install and offline notes.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat <<'EOF'
usage: run_stock.sh --tokenizer DIR --out DIR [options] [-- extra guidellm run args]

  --target URL          server base URL, no /v1 (default http://127.0.0.1:8000)
  --model NAME          model name sent in requests (default: the first of GET /v1/models)
  --tokenizer DIR       LOCAL tokenizer dir (tokenizer.json + tokenizer_config.json); required
  --out DIR             output dir (created); gets benchmarks.json, benchmarks.csv, console.log, summary.json
  --input-tokens N      prompt tokens, mean (default 1024)
  --input-spread F      uniform +-F around the mean: min=N*(1-F), max=N*(1+F) (default 0.5 -> 512..1536)
  --input-min N / --input-max N   explicit bounds instead of the spread (0 spread: every prompt N tokens)
  --output-tokens N     output tokens per request, exact (default 128)
  --concurrency N       concurrent streams (default 32)
  --requests N          requests to send (default 1024)
  --endpoint E          completions | chat (default completions: no chat template adds tokens)
  --prompts P           synthetic | vocab | auto (default auto). synthetic: guidellm's own synthetic_text
                        (English from Faker, cut to N tokens). vocab: make_prompts.py writes prompts.jsonl of
                        random vocabulary words, exactly N tokens each, fed as --data kind=json_file. auto: vocab
                        for a WordLevel tokenizer (bench/stock/tokenizer.py's: English would all be <unk>, which
                        guidellm's decode drops, so its prompts would be empty), else synthetic
  --seed N              synthetic data seed (default 42)
  --workers N           guidellm worker processes (GUIDELLM__MAX_WORKER_PROCESSES; guidellm's default 10)
  --api-key KEY         bearer token (or set OPENAI_API_KEY)
  --timeout S           per-request read timeout in seconds (default none)
  --tiny                CPU-sized workload: 128 +-50% in, 16 out, concurrency 4, 32 requests, 2 workers
                        (explicit flags given after --tiny override it)
  --guidellm CMD        how to run guidellm (default: $GUIDELLM, else `guidellm` on PATH, else `python3 -m guidellm`)
  --site DIR            prepend DIR to PYTHONPATH for guidellm only (wheels installed with pip --target)
  --no-check            do not exit 3 when a request failed or an output length differs from --output-tokens
EOF
}

target=http://127.0.0.1:8000 model="" tokenizer="" out="" in_tok=1024 spread=0.5 in_min="" in_max=""
out_tok=128 conc=32 nreq=1024 endpoint=completions seed=42 workers="" api_key="${OPENAI_API_KEY:-}" timeout=""
guidellm_cmd="${GUIDELLM:-}" site="" check=1 prompts=auto extra=()
while (($#)); do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --tokenizer) tokenizer="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --input-tokens) in_tok="$2"; shift 2 ;;
    --input-spread) spread="$2"; in_min=""; in_max=""; shift 2 ;;
    --input-min) in_min="$2"; shift 2 ;;
    --input-max) in_max="$2"; shift 2 ;;
    --output-tokens) out_tok="$2"; shift 2 ;;
    --concurrency) conc="$2"; shift 2 ;;
    --requests) nreq="$2"; shift 2 ;;
    --endpoint) endpoint="$2"; shift 2 ;;
    --prompts) prompts="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --workers) workers="$2"; shift 2 ;;
    --api-key) api_key="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --tiny) in_tok=128 spread=0.5 in_min="" in_max="" out_tok=16 conc=4 nreq=32 workers=2; shift ;;
    --guidellm) guidellm_cmd="$2"; shift 2 ;;
    --site) site="$2"; shift 2 ;;
    --no-check) check=0; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run_stock.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done

[[ -n "$tokenizer" ]] || { echo "run_stock.sh: --tokenizer DIR is required (a local directory)" >&2; exit 2; }
[[ -d "$tokenizer" ]] || { echo "run_stock.sh: --tokenizer $tokenizer: not a directory (only local tokenizers: nothing is downloaded)" >&2; exit 2; }
[[ -f "$tokenizer/tokenizer.json" || -f "$tokenizer/tokenizer.model" || -f "$tokenizer/vocab.json" ]] ||
  { echo "run_stock.sh: --tokenizer $tokenizer: no tokenizer.json / tokenizer.model / vocab.json in it" >&2; exit 2; }
[[ -n "$out" ]] || { echo "run_stock.sh: --out DIR is required" >&2; exit 2; }
case "$endpoint" in
  completions|/v1/completions) fmt=/v1/completions ;;
  chat|/v1/chat/completions) fmt=/v1/chat/completions ;;
  *) echo "run_stock.sh: --endpoint must be completions or chat" >&2; exit 2 ;;
esac
case "$prompts" in synthetic|vocab|auto) ;; *) echo "run_stock.sh: --prompts must be synthetic, vocab or auto" >&2; exit 2 ;; esac
for v in in_tok out_tok conc nreq seed; do
  [[ "${!v}" =~ ^[0-9]+$ && "${!v}" -gt 0 || ( "$v" == seed && "${!v}" =~ ^[0-9]+$ ) ]] ||
    { echo "run_stock.sh: $v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
[[ "$spread" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "run_stock.sh: --input-spread must be a number, got '$spread'" >&2; exit 2; }
if [[ -z "$in_min" ]]; then in_min=$(python3 -c "print(max(1, round($in_tok * (1 - $spread))))"); fi
if [[ -z "$in_max" ]]; then in_max=$(python3 -c "print(round($in_tok * (1 + $spread)))"); fi
[[ "$in_min" =~ ^[0-9]+$ && "$in_max" =~ ^[0-9]+$ && "$in_min" -ge 1 && "$in_min" -le "$in_max" ]] ||
  { echo "run_stock.sh: input bounds must be integers with 1 <= min <= max, got $in_min..$in_max" >&2; exit 2; }
tokenizer="$(cd "$tokenizer" && pwd)"
mkdir -p "$out"; out="$(cd "$out" && pwd)"
rm -f "$out"/{benchmarks.json,benchmarks.csv,summary.json,prompts.jsonl,console.log,command.txt}

# Offline: never reach the Hugging Face hub (tokenizer and datasets are local / synthetic), no telemetry.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
  HF_HUB_DISABLE_IMPLICIT_TOKEN=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[[ -n "$workers" ]] && export GUIDELLM__MAX_WORKER_PROCESSES="$workers"
[[ -n "$site" ]] && export PYTHONPATH="$(cd "$site" && pwd)${PYTHONPATH:+:$PYTHONPATH}"

if [[ -z "$guidellm_cmd" ]]; then
  if command -v guidellm >/dev/null 2>&1; then guidellm_cmd=guidellm; else guidellm_cmd="python3 -m guidellm"; fi
fi
read -r -a gl <<<"$guidellm_cmd"

backend="kind=openai_http,target=${target%/},request_format=$fmt"
[[ -n "$model" ]] && backend+=",model=$model"
[[ -n "$timeout" ]] && backend+=",timeout=$timeout"
[[ -n "$api_key" ]] && backend+=",api_key=$api_key"
# make_prompts.py needs transformers: run it with the python that runs guidellm (`python -m guidellm`'s, or the
# interpreter on the guidellm script's #! line)
py=python3
if [[ "$(basename "${gl[0]}")" == python* ]]; then
  py="${gl[0]}"
elif exe="$(command -v "${gl[0]}")" && [[ "$(head -c 2 "$exe")" == '#!' ]]; then
  shebang="$(head -1 "$exe" | cut -c3-)"; [[ -x "${shebang%% *}" ]] && py="${shebang%% *}"
fi
if [[ "$prompts" == auto ]]; then
  prompts=synthetic
  "$py" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["model"]["type"] != "WordLevel")' \
    "$tokenizer/tokenizer.json" 2>/dev/null && prompts=vocab
fi
if [[ "$prompts" == vocab ]]; then
  "$py" "$HERE/make_prompts.py" --tokenizer "$tokenizer" --out "$out/prompts.jsonl" --count "$nreq" \
    --min "$in_min" --max "$in_max" --output-tokens "$out_tok" --seed "$seed"
  data="kind=json_file,path=$out/prompts.jsonl"
  # datasets caches the file it loads: keep that out of --out and out of ~/.cache
  HF_DATASETS_CACHE="$(mktemp -d)"; export HF_DATASETS_CACHE; trap 'rm -rf "$HF_DATASETS_CACHE"' EXIT
else
  data="kind=synthetic_text,prompt_tokens=$in_tok,prompt_tokens_min=$in_min,prompt_tokens_max=$in_max,output_tokens=$out_tok"
fi

cmd=("${gl[@]}" run
  --backend "$backend"
  --tokenizer "kind=huggingface_auto,model=$tokenizer"
  --data "$data"
  --profile "kind=concurrent,streams=$conc"
  --constraint "kind=max_requests,count=$nreq"
  --seed "kind=static,value=$seed"
  --output "kind=json,path=$out/benchmarks.json"
  --output "kind=csv,path=$out/benchmarks.csv"
  --disable-console-interactive
  ${extra[@]+"${extra[@]}"})

{
  printf '%q ' "${cmd[@]}" | sed "s/api_key=[^,' ]*/api_key=REDACTED/g"; echo
  echo "# guidellm: $("${gl[@]}" --version 2>&1 | tail -1)"
  echo "# workload: input uniform $in_min..$in_max tokens ($prompts prompts), output $out_tok (ignore_eos), concurrency $conc, $nreq requests, $fmt"
} >"$out/command.txt"
cat "$out/command.txt"

cd "$out"  # guidellm writes nothing else unless GUIDELLM__LOGGING__LOG_FILE_LEVEL is set; keep it here if so
set +e
"${cmd[@]}" 2>&1 | tee "$out/console.log"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 || ! -s "$out/benchmarks.json" ]]; then
  echo "run_stock.sh: guidellm exited $rc; see $out/console.log" >&2
  exit $(( rc ? rc : 1 ))
fi
checks=()
((check)) && checks=(--expect-output-tokens "$out_tok" --expect-requests "$nreq" --expect-prompt-min "$in_min")
set +e
python3 "$HERE/summarize.py" "$out/benchmarks.json" --out "$out/summary.json" ${checks[@]+"${checks[@]}"} >/dev/null
src=$?
set -e
[[ -s "$out/summary.json" ]] || { echo "run_stock.sh: summarize.py failed ($src)" >&2; exit $(( src ? src : 1 )); }
python3 - "$out/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
r = s["requests"]
print(f"\nsummary ({sys.argv[1]}): {r['completed']}/{r['total']} completed, {r['failed']} failed, "
      f"{r['incomplete']} incomplete; output {s['output_tokens_per_s']} tok/s; "
      f"mean concurrency {s['concurrency_mean']}; TTFT p50 {s['ttft_ms']['p50']} ms; ITL p50/p99 {s['itl_ms']['p50']}/{s['itl_ms']['p99']} ms (guidellm's "
      f"per-request ITL); prompt tokens {s['prompt_tokens']['min']:.0f}..{s['prompt_tokens']['max']:.0f}; "
      f"output tokens {s['output_tokens']['min']:.0f}..{s['output_tokens']['max']:.0f}; checks: {s['checks']}")
EOF
exit $src
