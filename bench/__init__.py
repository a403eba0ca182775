"""Bench client: ttft, offload, link and serve benchmarks behind one CLI (bench.cli)."""
