"""The compute roofline beside a `serve` run: whether it is measured, the GEMM rate, and each run's figures.

Why apart from the load (serve_load.py): the rate is measured once per command, before the first load, in this
process on its GPU (bench/measure/roofline.py says what is counted), and a sweep puts the same measurement beside
every run; a load knows nothing of it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.common import Step
from bench.measure import roofline
from bench.runs.serve_config import ServeConfig
from bench.runs.serve_load import make_prompts
from kvtransfer.model.spec import load_config


@dataclass(frozen=True)
class RooflinePlan:
    """Whether the run measures the roofline: `why_not` empty when it does; `asked`: --roofline given (then a
    failed measurement is a failed check; by default it is a note)."""
    dims: roofline.Dims | None
    device: str
    why_not: str
    asked: bool


def roofline_plan(args: argparse.Namespace, cfg: ServeConfig) -> RooflinePlan:
    """--roofline / --no-roofline / neither (on where this process sees a CUDA device and --model is given). Asked
    for where it cannot run: ValueError (a usage error) saying why."""
    asked = getattr(args, "roofline", None)
    dims = roofline.Dims.of(load_config(cfg.model)) if cfg.model is not None else None
    if asked is False:
        why = "off (--no-roofline)"
    elif dims is None:
        why = "no --model (only --vocab-size): the model's layer shapes are unknown"
    elif not roofline.cuda_visible():
        why = "this bench process sees no CUDA device, and the GEMM rate is measured on a GPU only"
    else:
        why = ""
    if asked and why:
        raise ValueError(f"--roofline: {why}")
    return RooflinePlan(dims, getattr(args, "roofline_device", "cuda"), why, bool(asked))


def measure_roofline(plan: RooflinePlan, step: Step) -> dict:
    """The result's `roofline` record: the measured GEMM rates (bench/measure/roofline.py), or why there are none."""
    if plan.why_not:
        return {"on": False, "why": plan.why_not}
    try:
        measured = roofline.measure_gemm(plan.dims, plan.device)
    except Exception as e:  # the load still runs; the report says why the roofline is absent
        return {"on": False, "why": f"the GEMM measurement failed on {plan.device}: {type(e).__name__}: {e}",
                "failed": True}
    finally:
        step("roofline: GEMM rate")
    return {"on": True, **measured, "counted": roofline.COUNTED}


def roofline_failure(plan: RooflinePlan, roof: dict) -> list[str]:
    return [f"--roofline: {roof['why']}"] if plan.asked and roof.get("failed") else []


def with_roofline(r: dict, cfg: ServeConfig, plan: RooflinePlan, roof: dict) -> dict:
    """A run's result with its roofline figures (None where the roofline is off) and the `roofline` record."""
    figures = dict.fromkeys(("roofline_output_tok_s", "gemm_tflops", "of_roofline"))
    if roof["on"]:
        # priced as the requests that completed ran (a --stop-after or EOS ends one sooner), else as planned
        done = list(zip(r.get("input_lens") or (), r.get("output_lens") or ()))
        prompts, outs = ([p for p, _ in done], [o for _, o in done]) if done else \
            ([len(p) for p in make_prompts(cfg)], cfg.output_len)
        figures = roofline.run_figures(roof, plan.dims, prompts, outs, r["output_throughput"])
    r |= figures | {"roofline": roof}
    if failed := roofline_failure(plan, roof):
        r["failures"] = [*r["failures"], *failed]
        r["ok"] = False
    return r

