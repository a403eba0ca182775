"""bench/probes/profile_mixed.py on CPU (`tiny`, eager): the mixed step it profiles carries the prompt rows asked for
beside the decode rows (a probe that silently profiled a decode-only step would show none through the chunk
kernel), and its JSON has every category; plus the alignment that labels a graph replay's kernels on the GPU."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

from bench.probes import profile_step
from bench.probes.kernel_labels import CATEGORIES, align, label_of


def test_mixed_step_profile_on_cpu():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # through profile_step, as the GPU command runs it
        profile_step.main(["--model", "tiny", "--device", "cpu", "--mixed", "32", "--batch", "4", "--context", "64",
                           "--pieces", "2", "--prompt-start", "16", "--prompt-len", "30", "--runs", "5",
                           "--replays", "1"])
    r = json.loads(out.getvalue().strip().splitlines()[-1])
    assert r["bench"] == "profile_mixed" and r["step_ms"] > 0 and r["busy_ms"] > 0
    assert (r["decode_rows"], r["prompt_rows"], r["prompt_pieces"], r["prompt_tokens"]) == (4, 28, 2, 28)
    assert r["step_rows"] == 32 and r["padding_rows"] == 0
    assert r["lm_head_rows"] == 4 + 2  # eager: the decode rows and each chunk's last row
    assert r["gemm_shapes"]["qkv"][0] == r["gemm_shapes"]["down"][0] == 32
    assert set(r["categories"]) == set(CATEGORIES)
    assert abs(sum(c["share"] for c in r["categories"].values()) - 1) < 1e-6
    for label in ("attn_decode", "attn_chunk", "qkv", "o", "gate_up", "down", "lm_head", "norm", "rope", "sample"):
        assert r["labels"][label]["ms"] > 0, label
    assert r["categories"]["attention"]["ms"] >= r["labels"]["attn_chunk"]["ms"]


def test_align_labels_replays_by_the_eager_sequence():
    ref = [("memcpy", "inputs"), ("nvjet_a", "qkv"), ("_rope_store_kernel", "rope"), ("_chunk_attention", "attn_chunk"),
           ("nvjet_a", "o"), ("reduce_ArgMaxOps", "sample")]
    one = [n for n, _ in ref]
    other = ["memcpy", "sm90_xmma_gemm", "_rope_store_kernel", "_chunk_attention", "nvjet_a", "reduce_ArgMaxOps"]
    kern = [SimpleNamespace(name=n) for n in one + other]  # replay 2 ran another GEMM kernel for qkv
    labels, matched = align(kern, ref, 2)
    assert labels[:6] == [lab for _, lab in ref]
    assert labels[6:] == ["inputs", "gemm", "rope", "attn_chunk", "o", "sample"] and matched == 11
    labels, _ = align(kern[:-1], ref, 2)  # uneven: aligned as a whole against the sequence twice over
    assert labels[:6] == [lab for _, lab in ref] and labels[-1] == "o"


def test_label_of_walks_to_the_innermost_range():
    outer = SimpleNamespace(name="kvt:inputs", cpu_parent=None, device_type=None)
    op = SimpleNamespace(name="aten::mm", cpu_parent=SimpleNamespace(name="kvt:qkv", cpu_parent=outer))
    kernel = SimpleNamespace(name="nvjet", linked_correlation_id=7, device_type="cuda")
    assert label_of(kernel, {7: op}) == "qkv"
    assert label_of(SimpleNamespace(name="x", linked_correlation_id=8, device_type="cuda"), {7: op}) is None


def test_eager_graph_runs_the_captured_forward_on_the_step_buffers():
    """What the labeling pass runs in place of a graph replay: the padded layout of graphs.py, on CPU."""
    import argparse

    import torch

    from bench.probes.kernel_labels import EagerGraph
    from bench.probes.mixed_step import build
    from kvtransfer.engine.mixed import mixed_forward

    a = argparse.Namespace(model="tiny", device="cpu", dtype="", mixed=32, batch=3, context=40, pieces=1,
                           prompt_start=8, prompt_len=40, max_batch=16, page=16, eager=True)
    with torch.inference_mode():
        st, b, tok, pos, slots, chunks = build(a)
        want, want_last = mixed_forward(st.runner, tok, pos, slots, chunks)  # eager, unpadded
        st._inputs()  # what capture allocates: the input buffers the graphs read
        fake = EagerGraph(st, 32, b)
        st.mixed_graphs[32, b] = (fake, torch.empty(b + 4, want.shape[1]))
        st.mixed(tok, pos, slots, chunks)
    assert b == 4 and fake.last.shape[0] == b + 4  # bucket 4 (one padding row), 4 pieces' rows kept
    torch.testing.assert_close(fake.last[:3], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fake.last[b:b + 1], want_last, rtol=1e-4, atol=1e-4)


def test_reference_labels_with_and_without_the_profilers_link():
    """torch >= 2.12 links a kernel to its launch (linked_correlation_id); torch 2.11 lists a launch's kernels on its
    CPU event. Both give the range's label; a count that does not match falls back to the kernels' names."""
    from torch.autograd import DeviceType

    from bench.probes.profile_mixed import reference_labels

    def ev(name, dev, start, **kw):
        return SimpleNamespace(name=name, device_type=dev, time_range=SimpleNamespace(start=start), **kw)
    qkv = ev("kvt:qkv", DeviceType.CPU, 0, cpu_parent=None, id=1, linked_correlation_id=0)
    launch = ev("cudaLaunchKernel", DeviceType.CPU, 1, cpu_parent=qkv, id=7, linked_correlation_id=0)
    k = ev("sm90_xmma_gemm_bf16", DeviceType.CUDA, 2, id=8, linked_correlation_id=7)
    assert reference_labels([qkv, launch, k]) == [("sm90_xmma_gemm_bf16", "qkv")]
    old = [ev("kvt:qkv", DeviceType.CPU, 0, cpu_parent=None, kernels=[], is_legacy=False),
           ev("cudaLaunchKernel", DeviceType.CPU, 1, cpu_parent=None, kernels=[SimpleNamespace(name="g")],
              is_legacy=False),
           ev("g", DeviceType.CUDA, 2)]
    old[1].cpu_parent = old[0]
    assert reference_labels(old) == [("g", "qkv")]
    old[1].kernels = []  # no launch lists it: by name
    assert reference_labels(old) == [("g", "other")]


def test_gemms_unnamed_by_the_ranges_are_named_by_their_place_in_the_step():
    """torch 2.11 links no kernel to its range, so every cuBLAS kernel reads "gemm": a layer's four come in qkv, o,
    gate_up, down order and the lm_head last, per replay; a count that is not 4 x layers + 1 a replay, or a GEMM the
    ranges did name, leaves the labels as they are."""
    from bench.probes.kernel_labels import gemms_by_position

    step = ["norm", "gemm", "rope", "attn_decode", "gemm", "norm", "gemm", "silu", "gemm"] * 2 + ["norm", "gemm",
                                                                                                  "sample"]
    labels = gemms_by_position(step * 2, layers=2, replays=2)
    named = [lab for lab in labels if lab not in ("norm", "rope", "attn_decode", "silu", "sample")]
    assert named == ["qkv", "o", "gate_up", "down", "qkv", "o", "gate_up", "down", "lm_head"] * 2
    assert labels[2] == "rope" and labels[-1] == "sample"
    assert gemms_by_position(step[:-2] * 2, layers=2, replays=2) == step[:-2] * 2  # 8 GEMMs a replay, not 9
    partly = ["qkv" if i == 1 else lab for i, lab in enumerate(step)]
    assert gemms_by_position(partly, layers=2, replays=1) == partly


def test_covered_counts_overlapping_kernels_once():
    """The step's kernel time as a union: two streams' overlapping kernels count once, a gap not at all (kills
    `max(start, reach)` -> `start`: the side stream's overlap counted twice, and `end > reach`: a kernel inside
    another one added)."""
    from bench.probes.profile_mixed import covered_us
    assert covered_us([]) == 0
    assert covered_us([(0, 10), (5, 15), (20, 30)]) == 25  # overlap counted once, gap 15..20 left out
    assert covered_us([(0, 10), (2, 4), (12, 13)]) == 11  # one inside another
    assert covered_us([(20, 30), (0, 10)]) == 20  # in any order


def test_the_side_streams_price_is_of_the_two_kernels():
    """--no-side-stream prices the two kernels' side stream: beside --attention fused it is refused, never silently a
    no-op; alone it runs the two kernels, and the engine's own choice (runner.MIXED_ATTENTION) is back after the run
    (on CPU neither fuses: the reference ops)."""
    import pytest

    from bench.probes import profile_mixed
    from kvtransfer.engine import runner

    with pytest.raises(SystemExit) as refused, contextlib.redirect_stderr(io.StringIO()):
        profile_mixed.main(["--model", "tiny", "--device", "cpu", "--attention", "fused", "--no-side-stream"])
    assert refused.value.code == 2
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        profile_mixed.main(["--model", "tiny", "--device", "cpu", "--mixed", "16", "--batch", "4", "--context", "32",
                            "--prompt-start", "8", "--prompt-len", "24", "--runs", "5", "--replays", "1",
                            "--no-side-stream"])
    r = json.loads(out.getvalue().strip().splitlines()[-1])
    assert r["attention"] == "two" and r["side_stream"] is False
    assert runner.MIXED_ATTENTION == "fused"
