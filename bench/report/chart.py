"""Saving a chart: matplotlib's object API on an Agg canvas (no pyplot).

Why: no global backend state, no display needed, safe on a headless GPU box and in tests. Each
kind's `plot` (bench/report/<kind>.py) draws a Figure and saves it here, next to result.json.
"""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def save(fig: Figure, out_dir: str, name: str) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight")
    return name

