"""One-box launch: `torchrun --standalone --nproc-per-node 2 deploy/torchrun_pair.py [flags]`.

Rank 0 runs the prefill server on cuda:0 (cpu without CUDA), rank 1 the decode server on
cuda:1; torchrun's env:// rendezvous joins them. Flags shared by both go as they are
(--model, --dtype, --seed, --deterministic, ...); role-only flags go through
--prefill-args "..." and --decode-args "...".
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deploy.xpyd_plan import Parser  # noqa: E402 (after the path: run as a script by torchrun)


class PairParser(Parser):
    """launch_xpyd's parser (a lone flag as a --*-args value: `--decode-args "--no-prefix-cache"`), for the two
    servers' flags here."""

    PASSED = ("--prefill-args", "--decode-args")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this launcher's flags, the flags both servers get)."""
    p = PairParser(prog="torchrun_pair", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-args", default="", help="extra flags for the prefill server")
    p.add_argument("--decode-args", default="", help="extra flags for the decode server")
    p.add_argument("--deterministic", action="store_true")
    return p.parse_known_args(argv)


def main() -> None:
    rank, local = int(os.environ.get("RANK", "-1")), int(os.environ.get("LOCAL_RANK", "0"))
    if rank not in (0, 1) or os.environ.get("WORLD_SIZE") != "2":
        sys.exit("run under torchrun with --nproc-per-node 2 (RANK 0 = prefill, RANK 1 = decode)")
    known, shared = parse(sys.argv[1:])
    import torch
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    args = [*shared, "--device", device, "--dist-init", "env://"] + (["--deterministic"] if known.deterministic else [])
    if rank == 0:
        from prefill_server.__main__ import main as run
        run(args + shlex.split(known.prefill_args))
    else:
        from decode_server.__main__ import main as run
        run(args + shlex.split(known.decode_args))


if __name__ == "__main__":
    main()
