"""Stands in for `python3` while a runbook runs on CPU (tests/test_runbooks.py).

As the program (the shim's `python3`): records its command line and answers ok, importing nothing heavy, so a
runbook's every step costs milliseconds instead of an interpreter start with torch (~8 s each on a CI core).
`check(argv)`, called by the test in its own process for every recorded line afterwards: each bench command line
is parsed by the bench's own parser (and --decode-args by the decode server's); a line that does not parse, or an
unexpected python3 command, raises SystemExit.
"""

from __future__ import annotations

import json
import os
import shlex
import sys


def check(argv: list[str]) -> None:
    if argv[:2] == ["-m", "pytest"]:
        return
    if argv[:2] == ["-m", "bench.cli"]:
        from bench.cli import build_parser
        build_parser().parse_args(argv[2:])
        return
    if argv[:2] == ["-m", "bench.runs.serve_sweep"]:
        from bench.runs.serve_sweep import build_parser
        from decode_server.config import DecodeConfig
        from kvtransfer.rpc.configargs import from_args
        args = build_parser().parse_args(argv[2:])
        for extra in (args.decode_args, args.baseline_decode_args or ""):
            from_args(DecodeConfig, ["--device", "cpu", *shlex.split(extra)], "check", "kvtransfer-decode")
        return
    if argv[:2] == ["-m", "decode_server"]:  # a server the runbook starts itself (checked as on a CPU)
        from decode_server.config import DecodeConfig
        from kvtransfer.rpc.configargs import from_args
        from_args(DecodeConfig, [*argv[2:], "--device", "cpu"], "check", "kvtransfer-decode")
        return
    if argv[:2] == ["-m", "bench.probes.profile_mixed"]:
        from bench.probes.profile_mixed import build_parser as profile_parser
        profile_parser().parse_args(argv[2:])
        return
    if argv[:2] == ["-m", "bench.probes.chunk_attention"]:
        from bench.probes.chunk_attention import build_parser as attention_parser
        attention_parser().parse_args(argv[2:])
        return
    if argv[:1] == ["-c"] and "wait_serving" in argv[1]:  # waits for a server it started
        return
    raise SystemExit(f"runbook ran an unexpected python3 command: {shlex.join(argv)}")


if __name__ == "__main__":
    with open(os.environ["RUNBOOK_CALLS"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\n")
    print(json.dumps({"ok": True}))
