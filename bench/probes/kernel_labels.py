"""Labels for a mixed step's kernels: which projection, attention path or elementwise op each one is (profile_mixed.py).

Why apart: a replayed CUDA graph's kernels have no CPU op behind them, so profile_mixed runs the same step once
eagerly inside `labeled` (every op of kvtransfer/kernels/ops.py in a profiler range `kvt:<label>`, each projection
named by its weight, the rows each ran on noted) and `align`s the replays' kernels to that labeled sequence by
name (difflib); a kernel left unmatched is labeled from its name (`by_name`). This file holds that machinery,
profile_mixed.py the step, its timing and the report.
"""

from __future__ import annotations

import contextlib
import difflib
import re

from torch.autograd import DeviceType
from torch.profiler import record_function

from kvtransfer.engine.graphs import Step
from kvtransfer.engine.mixed import MAX_PIECES
from kvtransfer.engine.runner import StepRunner
from kvtransfer.kernels import ops

CATEGORY = {"qkv": "gemm", "o": "gemm", "gate_up": "gemm", "down": "gemm", "lm_head": "gemm", "gemm": "gemm",
            "attn_decode": "attention", "attn_chunk": "attention", "attn_mixed": "attention",
            "norm": "norm_rope_elementwise",
            "rope": "norm_rope_elementwise", "silu": "norm_rope_elementwise", "sample": "sampling"}
CATEGORIES = ("gemm", "attention", "norm_rope_elementwise", "sampling", "other")
# a kernel the alignment left unmatched: labeled by its name (cuBLAS: nvjet/xmma/cutlass; Triton: the kernels' names)
NAME_RULES = ((r"gemm|nvjet|xmma|cutlass|matmul|cublas|splitk", "gemm"), (r"decode_stage", "attn_decode"),
              (r"chunk_attention", "attn_chunk"), (r"mixed_attention", "attn_mixed"), (r"rope", "rope"), (r"norm", "norm"), (r"silu", "silu"),
              (r"argmax", "sample"))
WRAPPED = {"rms_norm": "norm", "add_rms_norm": "norm", "rope_store": "rope", "decode_attention": "attn_decode",
           "chunk_attention": "attn_chunk", "mixed_attention": "attn_mixed", "silu_mul": "silu", "gate_up_silu": "gate_up", "linear": None}


def by_name(name: str) -> str:
    return next((lab for pat, lab in NAME_RULES if re.search(pat, name, re.I)), "other")


@contextlib.contextmanager
def labeled(runner: StepRunner, seen: dict):
    """Within: every kernel op runs inside a profiler range `kvt:<label>` (linear: named by its weight), the runner's
    forward inside `kvt:step_misc` (its gathers and cats); `seen[label]` gets the op's rows (and N, K of a GEMM)."""
    names = {runner.lm_head.data_ptr(): "lm_head"}
    for w in runner.layers:
        names.update({w.qkv.data_ptr(): "qkv", w.o.data_ptr(): "o", w.down.data_ptr(): "down"})
    saved = {n: getattr(ops, n) for n in WRAPPED}

    def wrap(fn, fixed):
        def inner(*args, **kw):
            label = fixed or names.get(args[1].data_ptr(), "gemm")
            x = args[0]
            info = {"rows": int(x.shape[0])}
            if label in CATEGORY and CATEGORY[label] == "gemm":
                info |= {"n": int(args[1].shape[0]), "k": int(args[1].shape[1])}
            if label in ("attn_chunk", "attn_mixed"):  # the chunks this call attends for (its table: rows > 0)
                table = args[3] if label == "attn_chunk" else args[6]
                info["pieces"] = int(((table[:, 1] > 0) & (table[:, 2] >= 0)).sum())  # not the padding piece
            if label == "attn_mixed":  # one launch for both: its decode rows first
                info["decode"] = int(args[3])
            seen.setdefault(label, info)
            with record_function(f"kvt:{label}"):
                return fn(*args, **kw)
        return inner

    forward = runner.forward

    def labeled_forward(*args, **kw):
        with record_function("kvt:step_misc"):
            return forward(*args, **kw)

    try:
        for n, fixed in WRAPPED.items():
            setattr(ops, n, wrap(saved[n], fixed))
        runner.forward = labeled_forward
        yield
    finally:
        for n, fn in saved.items():
            setattr(ops, n, fn)
        del runner.forward


class EagerGraph:
    """Stands in for the captured graph of (rows, b) in `Step.mixed_graphs` during the labeling pass: the forward
    graphs.py captured, run eagerly on the same input buffers (its logits kept in `last`, not in the graph's)."""

    def __init__(self, st: Step, rows: int, b: int):
        self.st, self.rows, self.b, self.last = st, rows, b, None

    def replay(self) -> None:
        st, c, b = self.st, self.rows, self.b
        self.last = st.runner.forward(st.tokens[:c], st.positions[:c], st.slots[:c], st.keep[:b + MAX_PIECES],
                                      (b, st.pieces))


def label_of(e, cpu: dict) -> str | None:
    """The innermost `kvt:` range around the CPU op that launched device event e (or around CPU event e). cpu: the
    ops and ranges by id (CPU events whose linked_correlation_id is 0, as torch's own linking takes them)."""
    p = cpu.get(e.linked_correlation_id) if e.device_type != DeviceType.CPU else e
    while p is not None and not p.name.startswith("kvt:"):
        p = p.cpu_parent
    return None if p is None else p.name[4:]


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # each layer's GEMMs in launch order; the lm_head after the last


def gemms_by_position(labels: list[str], layers: int, replays: int) -> list[str]:
    """Name the GEMMs that only their kernel name labeled ("gemm"), by their place in the step: a layer launches qkv,
    o, gate_up, down in that order on the step's stream, and the lm_head comes last, so each replay has 4 x layers
    + 1 of them. Labels are left as they are when some GEMM already has its projection's name (the ranges linked
    it), or when the count is not that (another path ran: the GEMV, another model)."""
    at = [i for i, lab in enumerate(labels) if CATEGORY.get(lab) == "gemm"]
    per = 4 * layers + 1
    if any(labels[i] != "gemm" for i in at) or len(at) != per * replays:
        return labels
    names = [*PROJECTIONS * layers, "lm_head"] * replays
    out = list(labels)
    for i, name in zip(at, names):
        out[i] = name
    return out


def align(kern: list, ref: list[tuple[str, str]], replays: int) -> tuple[list[str], int]:
    """Labels for the replays' kernels from the labeled sequence `ref`, one replay's worth at a time when the
    count divides; (labels, how many came from the alignment)."""
    names, want = [e.name for e in kern], [n for n, _ in ref]
    per = max(1, len(names) // replays if len(names) % replays == 0 else len(names))
    if per == len(names):
        want = want * replays
    out, matched = [], 0
    for s in range(0, len(names), per):
        seg = names[s:s + per]
        labels = [None] * len(seg)
        for i, j, size in difflib.SequenceMatcher(None, seg, want, autojunk=False).get_matching_blocks():
            for k in range(size):
                labels[i + k] = ref[(j + k) % len(ref)][1]
        matched += sum(x is not None for x in labels)
        out += [x or by_name(n) for x, n in zip(labels, seg)]
    return out, matched
