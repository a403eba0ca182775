"""`kvtransfer-bench interference`: its options and its run, registered by bench/cli.py.

Why apart from cli.py: several subcommands grow there at once; this one's options live beside
its code, and cli.py hands in its shared `finish` and `with_progress` (no import cycle).
"""

from __future__ import annotations

import argparse
import shlex

import torch

from bench.interference import ARMS, InterferenceConfig, run_interference, total_steps


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def config(args: argparse.Namespace) -> InterferenceConfig:
    cuda = torch.cuda.is_available()
    device = args.device or ("cuda:0" if cuda else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    return InterferenceConfig(
        model=args.model, dtype=args.dtype or ("bfloat16" if on_gpu else "float32"), device=device,
        prefill_device=args.prefill_device, streams=args.streams, context=args.context,
        stream_tokens=args.stream_tokens, long_tokens=args.long_tokens, arrivals=tuple(args.arrivals),
        gap_s=args.gap_s, poisson_rate=args.poisson_rate, poisson_count=args.poisson_count,
        poisson_len=args.poisson_len, arms=tuple(args.arms), chunks=tuple(args.chunks),
        transport=args.transport or ("cuda_ipc" if on_gpu else "gloo"), ttft_slo_ms=args.ttft_slo_ms,
        itl_slo_ms=args.itl_slo_ms, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
        server_args=tuple(shlex.split(args.server_args)), seed=args.seed, log_dir=args.log_dir)


def register(sub, finish, with_progress) -> None:
    p = sub.add_parser("interference", help="how long prefills stall running decodes: colocated, chunked, disagg",
                       description="Per arm (fresh servers): B streams decode, long prompts arrive; reports the "
                                   "streams' ITL, the stall per arrival, the long prompts' TTFT and goodput.")
    p.add_argument("--model", default="tiny", help="preset or local dir (default tiny)")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", help="colocated server and the pair's decode server (default cuda:0, else cpu)")
    p.add_argument("--prefill-device", help="the pair's prefill server (default: --device, one shared device)")
    p.add_argument("--streams", type=int, default=32, help="running streams B (default 32)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of each stream (default 1024)")
    p.add_argument("--stream-tokens", type=int, help="max_new_tokens per stream (default min(2048, what fits))")
    p.add_argument("--long-tokens", type=int, default=4, help="max_new_tokens per long prompt (default 4)")
    p.add_argument("--arrivals", type=_ints, default=[4096, 16384, 32000],
                   help="single long prompts, one at a time (default 4096,16384,32000)")
    p.add_argument("--gap-s", type=float, default=1.0, help="before the first arrival and after each first token")
    p.add_argument("--poisson-rate", type=float, default=0.0, help="long prompts/s after the single ones (0: off)")
    p.add_argument("--poisson-count", type=int, default=8)
    p.add_argument("--poisson-len", type=int, default=4096)
    p.add_argument("--arms", type=_csv, default=list(ARMS), help=f"comma list of {','.join(ARMS)}")
    p.add_argument("--chunks", type=_ints, default=[512, 2048], help="--prefill-chunk per chunked arm")
    p.add_argument("--transport", help="disagg data plane (default cuda_ipc on cuda, gloo on cpu)")
    p.add_argument("--ttft-slo-ms", type=float, default=5000.0, help="long prompts' TTFT SLO (default 5000)")
    p.add_argument("--itl-slo-ms", type=float, default=100.0, help="every request's max ITL SLO (default 100)")
    p.add_argument("--max-batch", type=int, help="server slots (default streams + long prompts in flight)")
    p.add_argument("--max-seq-len", type=int, help="tokens per slot (default: the longest request)")
    p.add_argument("--server-args", default="", help="extra decode-server flags, e.g. '--no-cuda-graphs'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="server logs here (default a temp dir)")
    p.add_argument("--out", help="write result.json, report.md and interference.png in this directory")

    def cmd(args: argparse.Namespace) -> int:
        try:
            cfg = config(args)
        except ValueError as e:
            args.parser.error(str(e))
        return finish(args, with_progress(total_steps(cfg), lambda step: run_interference(cfg, step)))

    p.set_defaults(run=cmd, parser=p)
