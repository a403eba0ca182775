"""Every result kind and the module that reports it: the one table a new kind is added to.

Why a registry of its own: each kind's module (bench/report/<kind>.py) imports only downward
(bench.report.table, and bench.report.chart when it draws), this imports them all, and
bench.report.output and bench.cli read it; nothing in bench/report imports upward. A kind's
module has `tables(result) -> [Table]` and, optionally, `plot(result, out_dir) -> [(title, file)]`.
"""

from __future__ import annotations

from types import ModuleType

from bench.report import decode, interference, invariance, link, multiturn, offload, serve, ttft
from bench.report.table import Table

KINDS: dict[str, ModuleType] = {"offload": offload, "ttft": ttft, "link": link, "serve": serve, "decode": decode,
                                "interference": interference, "serve_multiturn": multiturn,
                                "invariance": invariance}  # result["kind"] -> module


def tables_for(result: dict) -> list[Table]:
    return KINDS[result["kind"]].tables(result)


def plots_for(result: dict, out_dir: str) -> list[tuple[str, str]]:
    """Write the result kind's charts into `out_dir`; [] for kinds without one."""
    plot = getattr(KINDS.get(result["kind"]), "plot", None)
    return plot(result, out_dir) if plot else []
