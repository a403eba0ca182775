"""A local model directory that cannot be served is refused at start in one line, exit 2, by both servers.

Why real processes: what an operator sees is the server's exit code and its log, not an exception in a
test (forked from the test worker's fork server, support/forked.py: the flags, the load and the exit are the
server's own, without seconds of imports per start). Each broken directory is a copy of one `save_pretrained`
wrote for the `tiny` preset, broken one way: no safetensors, a safetensors cut to half, no config.json, an
architecture the engine does not run. Both servers of a case start at once. The in-process tests check what
needs no server: the intact, sharded and tied directories still load, and weights the checkpoint lacks are
refused instead of left random.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from bench.measure.launch import stop
from kvtransfer.model.spec import PRESETS, ModelSpec, load_model, weights_fingerprint
from support.forked import spawn

START_DEADLINE_S = 180  # a refused start ends well within this; a server that does start would serve forever


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    d = tmp_path_factory.mktemp("intact")
    load_model(ModelSpec("tiny", "float32", 0)).save_pretrained(d)
    return d


def _copy(intact, tmp_path, name: str):
    d = tmp_path / name
    shutil.copytree(intact, d)
    return d


def _no_safetensors(d):
    os.remove(d / "model.safetensors")


def _half_safetensors(d):
    path = d / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _no_config(d):
    os.remove(d / "config.json")


def _edit_config(**changes):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


# (name, how to break the copy, words the one error line must hold besides the directory)
BROKEN = [
    ("no-safetensors", _no_safetensors, ["no model.safetensors", "copy"]),
    ("half-safetensors", _half_safetensors, ["model.safetensors is truncated", "again"]),
    ("no-config", _no_config, ["no config.json", "config.json and *.safetensors"]),
    ("gpt2", _edit_config(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
     ["model type 'gpt2'", "not supported", "llama, qwen2, mistral"]),
    ("made-up", _edit_config(model_type="made-up-decoder", architectures=["MadeUpForCausalLM"]),
     ["model type 'made-up-decoder'", "not supported", "llama, qwen2, mistral"]),
]

SERVERS = {
    "decode": ("decode_server", ["--colocated"]),
    "prefill": ("prefill_server", []),
}


@pytest.mark.parametrize("name,brk,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_model_directory_exits_2_in_one_line(intact, tmp_path, name, brk, words):
    d = _copy(intact, tmp_path, name)
    brk(d)
    procs = {role: spawn(module, [*argv, "--model", str(d), "--device", "cpu", "--listen", "127.0.0.1:0"],
                         str(tmp_path / f"{role}.log"))
             for role, (module, argv) in SERVERS.items()}
    outs = {}
    try:
        for role, p in procs.items():
            try:
                p.wait(timeout=START_DEADLINE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{role} server started on the broken directory ({name}):\n"
                            f"{(tmp_path / f'{role}.log').read_text()[-3000:]}")
            outs[role] = (tmp_path / f"{role}.log").read_text()
    finally:
        stop(list(procs.values()), grace_s=5)
    for role, p in procs.items():
        out = outs[role]
        assert p.returncode == 2, f"{role}: rc {p.returncode}\n{out[-3000:]}"
        assert "Traceback" not in out, f"{role}:\n{out[-3000:]}"
        lines = [line for line in out.splitlines() if "cannot start:" in line]
        assert len(lines) == 1, f"{role}:\n{out[-3000:]}"
        tail = out[out.index(lines[0]):].strip()
        assert tail == lines[0], f"{role}: the error is not one line:\n{tail}"
        for word in [str(d), *words]:
            assert word in lines[0], f"{role}: {word!r} not in {lines[0]!r}"


# ---------------------------------------------------------------- in process: what must still load, what must not


def test_intact_sharded_and_tied_directories_load(intact, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig
    kw = dict(PRESETS["tiny"])
    kw.pop("cls")
    kw["tie_word_embeddings"] = True
    tied = AutoModelForCausalLM.from_config(LlamaConfig(head_dim=16, **kw))
    tied.save_pretrained(tmp_path / "tied")
    tied.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    want = weights_fingerprint(load_model(ModelSpec("tiny", "float32", 0)))
    assert weights_fingerprint(load_model(ModelSpec(str(intact), "float32"))) == want
    for d in ("tied", "sharded"):
        assert weights_fingerprint(load_model(ModelSpec(str(tmp_path / d), "float32"))) == weights_fingerprint(tied)


def test_missing_shard_is_refused(tmp_path):
    load_model(ModelSpec("tiny", "float32", 0)).save_pretrained(tmp_path, max_shard_size="300KB")
    last = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[-1]
    os.remove(tmp_path / last)
    with pytest.raises(ValueError, match=f"{last} is missing"):
        load_model(ModelSpec(str(tmp_path), "float32"))


@pytest.mark.parametrize("changes,what", [
    (dict(num_hidden_layers=5), "model.layers.4."),        # a layer the safetensors do not hold: not left random
    (dict(intermediate_size=256), "mlp.down_proj.weight"),  # another shape than the safetensors'
])
def test_config_that_does_not_match_the_weights_is_refused(intact, tmp_path, changes, what):
    d = _copy(intact, tmp_path, "mismatch")
    _edit_config(**changes)(d)
    with pytest.raises(ValueError, match="do not hold what config.json describes") as e:
        load_model(ModelSpec(str(d), "float32"))
    assert what in str(e.value) and str(d) in str(e.value) and "\n" not in str(e.value)
