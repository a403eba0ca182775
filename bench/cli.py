"""kvtransfer-bench: the bench client's command line.

Why this shape: every subcommand is registered by one small function (`register_*` in
`REGISTRY`) that adds its parser and sets `run=`; running a subcommand returns a plain
result dict, and `finish` does the rest the same way for all of them: rich tables,
result.json + charts (PNG) + report.md under --out, and the whole result as ONE JSON
object on the last stdout line. The exit status is non-zero when a check failed: the
result's `ok` is False and its `failures` (if any) say why.

Subcommands: offload, ttft, demo, link (raw link speeds), serve (load on a running server), decode
(the batched engine's step time over a (batch, context) grid), interference (long prefills stalling
running decodes).
To add one: write `register_x(sub)` that calls `sub.add_parser("x")`, adds options and
`set_defaults(run=cmd_x, parser=p)`, where `cmd_x(args) -> int` builds the config (a
frozen dataclass whose ValueError becomes a usage error), runs it under `with_progress`
and returns `finish(args, result)`; append `register_x` to REGISTRY, a table builder to
`bench.report.BUILDERS` and, optionally, a chart to `bench.plots.PLOTTERS`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench import interference_cli, link, serve
from bench.decode import register_decode
from bench.offload import OffloadConfig, run_offload, total_steps
from bench.ttft import TtftConfig, run_ttft
from bench.ttft import total_steps as ttft_steps
from bench.report import json_line, print_tables, tables_for, write_outputs
from kvtransfer.rpc.configargs import Parser
from kvtransfer.rpc.server import pick_device
from kvtransfer.rpc.stacks import exit_on_sigterm
from bench.measure.tiers import TIER_KINDS


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def default_device() -> str:
    return str(pick_device("auto"))


def with_progress(total: int, work: Callable[[Callable[[str], None]], dict]) -> dict:
    """Run `work(step)` under a rich progress bar on stderr; `step(text)` advances it by one."""
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("starting", total=total)
        return work(lambda text: bar.update(task, advance=1, description=text))


def finish(args: argparse.Namespace, result: dict) -> int:
    """Tables to stdout, files under --out, then the result as one JSON line (the last stdout line)."""
    tables = tables_for(result)
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 220)
    print_tables(tables, console)
    if getattr(args, "out", None):
        result["outputs"] = write_outputs(args.out, result, tables, args.command_line)
    if not result["ok"]:
        why = "; ".join(result.get("failures", [])) or "a moved or reloaded cache differs from the original"
        console.print(f"CHECK FAILED: {why} (see the tables)", markup=False)
    sys.stdout.write(json_line(result) + "\n")
    sys.stdout.flush()
    return 0 if result["ok"] else 1


def run_offload_cmd(args: argparse.Namespace, cfg: OffloadConfig) -> int:
    return finish(args, with_progress(total_steps(cfg), lambda step: run_offload(cfg, step)))


def cmd_offload(args: argparse.Namespace) -> int:
    device = args.device or default_device()
    dtype = args.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    models = [m for item in (args.model or ["tiny"]) for m in csv(item)]
    try:
        cfg = OffloadConfig(models=tuple(models), lengths=tuple(args.lengths), dtype=dtype, device=device,
                            runs=args.runs, warmup=args.warmup, decode_tokens=args.decode_tokens,
                            disk_dir=args.disk_dir, seed=args.seed, tiers=tuple(args.tiers),
                            peer_device=args.peer_device,
                            link_bytes=args.link_mib << 20 if args.link_mib else None)
    except ValueError as e:
        args.parser.error(str(e))
    return run_offload_cmd(args, cfg)


def run_ttft_cmd(args: argparse.Namespace, cfg: TtftConfig) -> int:
    return finish(args, with_progress(ttft_steps(cfg), lambda step: run_ttft(cfg, step)))


def cmd_ttft(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    try:
        cfg = TtftConfig(model=args.model, dtype=args.dtype or ("bfloat16" if cuda else "float32"),
                         lengths=tuple(args.lengths), modes=tuple(args.modes), runs=args.runs, warmup=args.warmup,
                         decode_tokens=args.decode_tokens,
                         prefill_device=args.prefill_device or ("cuda:0" if cuda else "cpu"),
                         decode_device=args.decode_device or ("cuda:1" if cuda else "cpu"),
                         layers_per_message=args.layers_per_message, transport=args.transport, verify=args.verify, log_dir=args.log_dir)
    except ValueError as e:
        args.parser.error(str(e))
    return run_ttft_cmd(args, cfg)


def cmd_demo(args: argparse.Namespace) -> int:
    """The disaggregated pair on CPU (gloo) beside colocated, tiny preset: the product in one minute."""
    cfg = TtftConfig(model="tiny", dtype="float32", lengths=(64, 1024), runs=5, warmup=2, decode_tokens=8,
                     prefill_device="cpu", decode_device="cpu")
    return run_ttft_cmd(args, cfg)


def register_ttft(sub) -> None:
    p = sub.add_parser("ttft", help="TTFT overhead: colocated vs disaggregated (layer-wise and bulk), verified",
                       description="Starts a colocated decode server and a prefill/decode pair as real processes; "
                                   "per prompt length reports TTFT, overhead, prefill slowdown and 2nd-token time; "
                                   "checks cache, tokens and logits equal in a separate deterministic pass.")
    p.add_argument("--model", default="tiny", help="preset or local dir (default tiny)")
    p.add_argument("--lengths", type=ints, default=[64, 512], help="comma list of prompt lengths")
    p.add_argument("--modes", type=csv, default=["layerwise", "bulk"], help="layerwise,bulk")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prefill-device", help="default cuda:0 (cpu without CUDA)")
    p.add_argument("--decode-device", help="default cuda:1 (cpu without CUDA)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=4, help=">= 2 (the second token is a decode step)")
    p.add_argument("--layers-per-message", type=int, default=1)
    p.add_argument("--transport", default="auto", help="auto (nccl on GPUs, gloo on CPU), grpc, cuda_ipc")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="deterministic pass checking cache, tokens and logits (default on)")
    p.add_argument("--log-dir", help="server logs here (default a temp dir)")
    p.add_argument("--out", help="write result.json and report.md in this directory")
    p.set_defaults(run=cmd_ttft, parser=p)


def register_offload(sub) -> None:
    p = sub.add_parser("offload", help="recompute vs offload/reload per host tier (the seed's part-3 table)",
                       description="Per model and context length: prefill time, offload and reload time per tier, "
                                   "reload speed-up, GB/s, break-even link speed; every reload verified.")
    p.add_argument("--model", action="append", help="preset or local dir; repeatable or comma list (default tiny)")
    p.add_argument("--lengths", type=ints, default=[128, 512], help="comma list of prompt lengths (default 128,512)")
    p.add_argument("--dtype", help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", help="default cuda if available, else cpu")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument("--decode-tokens", type=int, default=8, help="tokens decoded to verify each reload")
    p.add_argument("--tiers", type=csv, default=list(TIER_KINDS), help=f"comma list of {','.join(TIER_KINDS)} (gpu: a buffer on --device, "
                   "or --peer-device; on a CPU run that is a second copy in RAM)")
    p.add_argument("--peer-device", help="device for the gpu tier's buffer, e.g. cuda:1 (default: model device)")
    p.add_argument("--link-mib", type=int, help="raw link copy size in MiB (default: largest cache, >= 64)")
    p.add_argument("--disk-dir", help="directory for the disk tier's file (default: a fresh temp dir)")
    p.add_argument("--out", help="write result.json and report.md in this directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_offload, parser=p)


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="the disaggregated pair on CPU (gloo) beside colocated, tiny preset")
    p.add_argument("--out", help="write result.json and report.md in this directory")
    p.set_defaults(run=cmd_demo, parser=p)


def cmd_link(args: argparse.Namespace) -> int:
    try:
        cfg = link.LinkConfig(bytes=args.bytes, model=args.model, length=args.length, dtype=args.dtype,
                              layers=args.layers, runs=args.runs, warmup=args.warmup, channels=args.channels,
                              chunk_bytes=args.chunk, disk_dir=args.disk_dir, probes=tuple(args.probes))
    except ValueError as e:
        args.parser.error(str(e))
    return finish(args, with_progress(link.total_steps(cfg), lambda step: link.run_link(cfg, step)))


def serve_config(args: argparse.Namespace) -> serve.ServeConfig:
    """`serve`'s flags as its config; ValueError (a usage error, exit 2) says which flag to fix."""
    return serve.ServeConfig(addr=args.addr, num_prompts=args.num_prompts, concurrency=args.concurrency,
                             request_rate=args.request_rate, input_len=args.input_len,
                             input_len_range=args.input_len_range, output_len=args.output_len,
                             vocab_size=args.vocab_size, model=args.model, mode=args.mode, warmup=args.warmup,
                             seed=args.seed, timeout_s=args.timeout, max_duration_s=args.max_duration,
                             server_metrics=args.server_metrics, long_share=args.long_share,
                             long_len=args.long_len_range)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = serve_config(args)
        token = args.auth_token or (Path(args.auth_token_file).read_text().strip() if args.auth_token_file else "")
    except (ValueError, OSError) as e:
        args.parser.error(str(e))
    meta = (("authorization", f"Bearer {token}"),) if token else None
    return finish(args, with_progress(serve.total_steps(cfg), lambda step: serve.run_serve(cfg, step, meta)))


def register_link(sub) -> None:
    p = sub.add_parser("link", help="raw link speeds in one run: p2p, peer copy, H2D/D2H, socket, gRPC, disk",
                       description=link.__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--bytes", type=link.size,
                   help="whole-cache size, e.g. 1.75GiB (default: --model's cache at --length)")
    p.add_argument("--model", default="qwen2.5-7b", help="preset or local dir: cache size and layer count")
    p.add_argument("--length", type=int, default=4096, help="tokens of the cache (default 4096)")
    p.add_argument("--dtype", default="bfloat16", help="cache dtype for the size (default bfloat16)")
    p.add_argument("--layers", type=int, help="messages of the per-layer p2p pattern (default: the model's)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure, >= 5 (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--channels", type=int, default=1, help="loopback connections (socket, gRPC, gRPC transport)")
    p.add_argument("--chunk", type=link.size, default=4 << 20, help="gRPC message size (default 4MiB)")
    p.add_argument("--probes", type=csv, default=list(link.PROBES), help=f"subset of {','.join(link.PROBES)}")
    p.add_argument("--disk-dir", help="directory for the disk file (default: a fresh temp dir)")
    p.add_argument("--out", help="write result.json, report.md and links.png in this directory")
    p.set_defaults(run=cmd_link, parser=p)


def register_serve(sub) -> None:
    p = sub.add_parser("serve", help="load against a running decode server (vllm bench serve metrics)",
                       description=serve.__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--addr", default="127.0.0.1:50051", help="the decode server (loopback only)")
    p.add_argument("--server-metrics", default="", help="the decode server's /metrics URL (its --metrics-port): "
                   "report its batch size over the run")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, help="most requests in flight (default: no limit)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals/s (default inf)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--input-len-range", type=float, default=0.0, help="r: lengths uniform in len*[1-r, 1+r]")
    p.add_argument("--output-len", type=int, default=16)
    serve.add_long_prompt_flags(p)
    p.add_argument("--vocab-size", type=int, help="token ids uniform in [0, vocab) (or give --model)")
    p.add_argument("--model", help="the server's --model (preset or local dir): its vocabulary and context")
    p.add_argument("--mode", default="auto", help="auto, layerwise, bulk or colocated")
    p.add_argument("--warmup", type=int, default=1, help="requests before the clock starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="per request, s")
    p.add_argument("--max-duration", type=float, default=600.0, help="whole run, s; later requests are not sent")
    p.add_argument("--auth-token", help="bearer token, when the server requires one")
    p.add_argument("--auth-token-file")
    p.add_argument("--out", help="write result.json and report.md in this directory")
    p.set_defaults(run=cmd_serve, parser=p)


def register_interference(sub) -> None:
    interference_cli.register(sub, finish, with_progress)  # options and run: bench/interference_cli.py


REGISTRY: list[Callable] = [register_offload, register_ttft, register_demo, register_link, register_serve,
                            register_decode, register_interference]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvtransfer-bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRY:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself, not a caller's process (a test's): `timeout` gets stacks, then exit
        exit_on_sigterm()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["kvtransfer-bench", *argv])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
