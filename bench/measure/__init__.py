"""Measuring tools the runs share: timers and summary statistics, server processes, two-process
harness, raw links (p2p, copies, loopback socket and gRPC), page cache and host tiers, and the
per-bench bookkeeping (decode grid, server metrics, interference figures). Nothing here is a
subcommand or writes a report."""
