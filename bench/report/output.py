"""What a finished run leaves behind: the result as one JSON line, and under --out result.json,
the kind's charts and report.md.

Why apart from the tables: the JSON line is the machine-readable contract of every subcommand
(the last stdout line), and the files are written the same way for every kind.
"""

from __future__ import annotations

import json
import os
import sys

from bench.report.kinds import plots_for
from bench.report.table import Table, markdown


def json_line(result: dict) -> str:
    """The whole result as one line (allow_nan=False: a NaN or inf is a bug, not a number)."""
    return json.dumps(result, separators=(",", ":"), allow_nan=False)


def write_outputs(out_dir: str, result: dict, tables: list[Table], command: str | None) -> dict:
    """result.json, the kind's PNG charts (its `plot`) and report.md embedding them, under `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    paths = dict(json=os.path.join(out_dir, "result.json"), markdown=os.path.join(out_dir, "report.md"))
    with open(paths["json"] + ".tmp", "w") as f:  # written aside, then moved in: a kill mid-write (a sweep that
        json.dump(result, f, indent=1, allow_nan=False)  # rewrites it after every run) leaves the last whole one
        f.write("\n")
    os.replace(paths["json"] + ".tmp", paths["json"])
    try:  # matplotlib is imported by the kind's `plot`: only when files are written
        images = plots_for(result, out_dir)
    except Exception as e:  # the measurement is kept; the report says the chart is missing and why
        images, paths["plot_error"] = [], f"{type(e).__name__}: {e}"
        print(f"warning: no charts: {paths['plot_error']}", file=sys.stderr)
    paths["plots"] = [os.path.join(out_dir, p) for _, p in images]
    with open(paths["markdown"], "w") as f:
        f.write(markdown(tables, f"kvtransfer bench: {result['kind']}", command, images))
    return paths

