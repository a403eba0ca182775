"""Charts: an offload and a ttft result (small fakes, shaped as the commands write them) give valid
PNGs next to result.json, embedded in report.md."""

from __future__ import annotations

import struct

from bench.report.kinds import tables_for
from bench.report.output import write_outputs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def st(ms: float) -> dict:
    return {"median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.2, "runs": 5, "n": 5}


def tier(reload_ms: float, prefill_ms: float) -> dict:
    return {"available": True, "offload": st(reload_ms * 2), "reload": st(reload_ms), "offload_gbps": 1.0,
            "reload_gbps": 2.0, "byte_equal": True, "tokens_equal": True, "logits_equal": True,
            "decode_equal": True, "reload_speedup": prefill_ms / reload_ms}


def offload_result() -> dict:
    rows = []
    for n, pre in ((1024, 34.0), (32768, 1203.0)):
        rows.append({"model": "qwen2.5-7b", "length": n, "dtype": "bfloat16", "bytes_per_token": 57344,
                     "cache_bytes": 57344 * n, "prefill": st(pre), "prefill_us_per_token": pre * 1e3 / n,
                     "break_even_gbps": 2.0, "tiers": {
                         "gpu": tier(pre / 800, pre), "pinned": tier(pre / 18, pre), "pageable": tier(pre / 5, pre),
                         "disk": {"available": False, "skip_reason": "no disk here"}}})
    links = {"bytes": 1 << 20, "device_clone": st(0.1) | {"gbps": 10.0}}
    return {"kind": "offload", "ok": True, "config": {"device": "cuda", "dtype": "bfloat16", "runs": 5,
                                                       "decode_tokens": 8, "lengths": [1024, 32768]},
            "env": {"device_name": "fake", "disk_dir": "/tmp", "disk_fs": "ext4"}, "rows": rows, "links": links}


def ttft_result() -> dict:
    rows = []
    for n, colo in ((1024, 35.0), (32768, 1175.0)):
        for mode, extra in (("layerwise", 5.0), ("bulk", 8.0)):
            rows.append({"length": n, "mode": mode, "cache_bytes": 57344 * n, "ttft_colo": st(colo),
                         "ttft_disagg": st(colo + extra), "overhead_ms": extra, "overhead_pct": 100 * extra / colo,
                         "prefill_colo": st(colo), "prefill_disagg": st(colo), "prefill_slowdown_pct": 0.0,
                         "second_token_disagg": st(colo + 30)})
    cfg = {"model": "qwen2.5-7b", "dtype": "bfloat16", "prefill_device": "cuda:0", "decode_device": "cuda:1",
           "runs": 5, "warmup": 2}
    return {"kind": "ttft", "ok": True, "config": cfg, "verified": False, "rows": rows, "links": {}}


def check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 100 and data[-8:-4] == b"IEND"


def test_offload_plot(tmp_path):
    result = offload_result()
    paths = write_outputs(str(tmp_path), result, tables_for(result), "kvtransfer-bench offload")
    assert paths["plots"] == [str(tmp_path / "offload.png")] and "plot_error" not in paths
    check_png(tmp_path / "offload.png")
    assert "](offload.png)" in (tmp_path / "report.md").read_text()


def test_ttft_plot(tmp_path):
    result = ttft_result()
    paths = write_outputs(str(tmp_path), result, tables_for(result), None)
    assert paths["plots"] == [str(tmp_path / "ttft_overhead.png")]
    check_png(tmp_path / "ttft_overhead.png")
    md = (tmp_path / "report.md").read_text()
    assert "![TTFT overhead vs prompt length](ttft_overhead.png)" in md and (tmp_path / "result.json").exists()
