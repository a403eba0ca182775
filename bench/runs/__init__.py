"""One module per kvtransfer-bench subcommand's run (offload, ttft, demo, link, serve, decode,
interference), each with its config dataclass, its flags (`add_arguments`) and its `job(args)`, listed
once in bench/cli.py's table; plus the serve sweep driver (`python -m bench.runs.serve_sweep`) and the
decode run's HF baselines (decode_hf.py)."""
