"""Reports: a run's result dict turned into tables (rich on the terminal, Markdown in report.md), PNG charts
and the one-line JSON, one module per result kind (offload, ttft, link, serve, decode, interference) under a
registry (kinds.py) that the writers read; the kind modules import only the neutral pieces (table.py, chart.py),
so the room has no import circle. Nothing here runs a measurement."""
