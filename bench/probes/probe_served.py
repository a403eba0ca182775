"""The served part of bench.probes.probe_round: a local prefill's time in-process, then inside a colocated server.

Why: the serve sweep showed the server's own prefill several times slower under load than the same
code alone; this runs sequential prompts of 512..1536 tokens through the engine's scheduler, then through
a colocated server whose DEBUG log gives each prefill's wall and thread-CPU time.
"""

from __future__ import annotations

import time

import torch

from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec


def served(model_name: str, model, out_dir: str) -> dict:
    """Local prefill time of 1k-ish prompts: in-process through the engine's scheduler, then in a colocated server
    (timing.prefill_ms of each response), sequential requests of 512..1536 tokens."""
    import grpc
    import numpy as np

    from bench.measure.launch import colocated_server
    from kvtransfer.engine.engine import DecodeEngine, EngineOptions
    from kvtransfer.model.loaded import LoadedModel
    from proto import kvtransfer_pb2 as pb
    from proto import kvtransfer_pb2_grpc as pbg

    rng = np.random.default_rng(0)
    lens = [int(x) for x in rng.integers(512, 1537, 14)]
    spec = ModelSpec(model_name, "bfloat16", 0)
    dev = next(model.parameters()).device
    lm = LoadedModel(spec, model, CacheGeometry.from_config(model.config, torch.bfloat16), dev)
    eng = DecodeEngine(lm, EngineOptions(max_batch=8, max_seq_len=2048))
    inproc = []
    for n in lens:
        lease = eng.pool.try_lease()
        r = eng.prefill([int(t) for t in rng.integers(3, min(1000, model.config.vocab_size), n)], lease, False).result(timeout=60)
        lease.release()
        inproc.append(dict(tokens=n, ms=r.prefill_ms, cpu_ms=r.cpu_ms))
    eng.close()
    print("served: in-process", inproc, flush=True)
    remote = []
    with colocated_server(out_dir, model_name, "bfloat16", "cuda:0" if dev.type == "cuda" else "cpu",
                          args=["--max-batch", "8", "--max-seq-len", "2048", "--log-level", "DEBUG"]) as run:
        with grpc.insecure_channel(run.addr) as ch:
            stub = pbg.DecodeStub(ch)
            for n in lens:
                t0 = time.perf_counter()
                msgs = list(stub.Generate(pb.GenerateRequest(token_ids=[int(t) for t in rng.integers(3, min(1000, model.config.vocab_size), n)],
                                                             max_new_tokens=2), timeout=120))
                remote.append(dict(tokens=n, server_prefill_ms=msgs[0].timing.prefill_ms,
                                   client_ms=(time.perf_counter() - t0) * 1e3))
    print("served: server", remote, flush=True)
    return dict(in_process=inproc, server=remote)
