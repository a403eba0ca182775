"""kvtransfer-bench and the tools behind it, in rooms that import only downward: cli.py (the one table of
subcommands; nothing imports it) -> runs/ (one module per subcommand's run, and the serve sweep) -> report/
(tables, charts, the JSON line) and measure/ (timers, server processes, links, page cache, tiers);
common.py holds what the runs share. probes/ are development probes (`python -m bench.probes.<name>`)."""
