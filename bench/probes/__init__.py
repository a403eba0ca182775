"""Development probes: one-off measurements of engine internals (GEMV vs cuBLAS, step profile, mixed
steps, served prefill, kernel sweeps), run as `python -m bench.probes.<name>` on a GPU machine and
printing JSON. Not subcommands of kvtransfer-bench, and nothing outside this room imports them."""
