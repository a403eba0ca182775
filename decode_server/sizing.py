"""What the decode engine's `auto` flags become on the device at hand: dtype, prefill shape, KV pool.

Why here, once, after the weights are loaded: a user compares servers by starting them with no tuning
flags, so the defaults must be the configuration that measured fastest, sized to the device they find.
- dtype `auto` (kvtransfer.model.loaded.resolve_dtype): bfloat16 on CUDA, float32 on CPU.
- Prefill on CUDA: 256-row mixed steps (prompt chunks ride in the decode steps' forward), the measured
  fastest serving configuration; on CPU the whole prompt at once. Chunked and mixed prefill give up
  bit-identity between a request colocated and disaggregated (other kernel shapes); `--exact` restores it.
- The KV pool on CUDA takes what `--gpu-memory-utilization` of the device leaves after this process's
  weights and a workspace for one longest prompt's prefill (and the receive buffers of the data plane),
  like vLLM's gpu_memory_utilization; never more than is free now. `--kv-pool-gib` sets it outright.
  A slot holds the model's context (capped by the pool), and the pool's slots are what that leaves.
  On CPU, without --kv-pool-gib: 16 slots of at most 4,096 tokens.
Everything chosen is logged in one line with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30
FAST_PREFILL_CHUNK = 256  # rows of a mixed step (decode rows included): the fastest measured on an H200
MAX_AUTO_BATCH = 128  # auto slots stop here: a mixed step of 256 rows needs >= 2 per decode row; graphs per bucket
CPU_SLOTS, CPU_SEQ = 16, 4096  # CPU without --kv-pool-gib (tests, demos)
WORKSPACE = 2 * GIB  # CUDA graphs, cuBLAS workspaces, the allocator's slack


@dataclass(frozen=True)
class Memory:
    """A CUDA device's memory as this process sees it, bytes."""

    total: int
    free: int  # free on the device now (other processes' use counted)
    ours: int  # held by this process's allocator (the weights, by the time the pool is sized)


def device_memory(device: torch.device) -> Memory | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return Memory(total, free, torch.cuda.memory_reserved(device))


def workspace_bytes(config, bytes_per_token: int, max_prompt_tokens: int, elem_bytes: int,
                    receive_slots: int) -> int:
    """Device memory kept out of the pool: the activations of one longest prompt's prefill (its hidden states,
    q/k/v and the gate/up projections dominate), `receive_slots` caches of a longest prompt landing (the data
    plane's staging or cuda_ipc slots), and WORKSPACE."""
    hidden, inter = config.hidden_size, config.intermediate_size
    prefill = max_prompt_tokens * (6 * hidden + 3 * inter) * elem_bytes
    return WORKSPACE + prefill + receive_slots * max_prompt_tokens * bytes_per_token


@dataclass(frozen=True)
class PoolPlan:
    slots: int
    max_seq: int
    why: str


def plan_pool(bytes_per_token: int, context: int, max_batch: int, max_seq_len: int, kv_pool_gib: float,
              utilization: float, memory: Memory | None, workspace: int, batch_cap: int) -> PoolPlan:
    """Slots x tokens of the KV pool. 0 for max_batch / max_seq_len / kv_pool_gib means "choose"."""
    if kv_pool_gib:
        budget, source = int(kv_pool_gib * GIB), f"--kv-pool-gib {kv_pool_gib:g}"
    elif memory is not None:
        allowed = int(utilization * memory.total) - memory.ours - workspace
        budget = min(allowed, memory.free - workspace)
        source = (f"{utilization:g} of {memory.total / GIB:.1f} GiB (--gpu-memory-utilization) less "
                  f"{memory.ours / GIB:.1f} GiB of weights and {workspace / GIB:.1f} GiB of workspace"
                  + (f", capped by {memory.free / GIB:.1f} GiB free now" if budget < allowed else ""))
    else:
        budget, source = 0, ""
    if max_batch and max_seq_len:
        pool = max_batch * max_seq_len * bytes_per_token
        if memory is not None and pool > memory.free - WORKSPACE:
            raise ValueError(f"a KV pool of --max-batch {max_batch} x --max-seq-len {max_seq_len} tokens is "
                             f"{pool / GIB:.1f} GiB; {memory.free / GIB:.1f} GiB of the device is free: lower either "
                             "flag, or set neither and let the pool fit the device")
        return PoolPlan(max_batch, max_seq_len, "--max-batch and --max-seq-len as given")
    if not source:  # CPU, nothing said: the small fixed pool
        seq = max_seq_len or min(context, CPU_SEQ)
        return PoolPlan(max_batch or CPU_SLOTS, seq, "CPU default" if not (max_batch or max_seq_len) else
                        "CPU default for the flag not given")
    tokens = budget // bytes_per_token
    if tokens < 2 * max(max_batch, 1):
        raise ValueError(f"no room for a KV pool: {source} leaves {max(budget, 0) / GIB:.2f} GiB; raise "
                         "--gpu-memory-utilization, pass --kv-pool-gib, or use a smaller model or --max-prompt-tokens")
    if max_batch:
        seq = min(context, tokens // max_batch)
        return PoolPlan(max_batch, seq, f"{source}: {max_batch} slots (--max-batch) of {seq} tokens")
    seq = max_seq_len or min(context, tokens)
    slots = max(1, min(batch_cap, tokens // seq))
    capped = " (the cap)" if slots == batch_cap and tokens // seq > batch_cap else ""
    return PoolPlan(slots, seq, f"{source}: {slots} slots{capped} of {seq} tokens"
                    + ("" if max_seq_len else " (the model's context)" if seq == context else " (all the pool holds)"))


def plan_engine(config, loaded, receive_slots: int):
    """EngineOptions for `config` on `loaded`'s device, and the one log line saying what was chosen and why.
    `receive_slots`: longest-prompt caches the data plane may hold on the device (0 colocated)."""
    from kvtransfer.engine.engine import EngineOptions

    cuda = loaded.device.type == "cuda"
    if config.exact:
        chunk, mixed, prefill_why = 0, False, "whole prompts (--exact)"
    else:
        auto_chunk = config.prefill_chunk < 0
        chunk = (FAST_PREFILL_CHUNK if cuda or config.mixed_prefill else 0) if auto_chunk else config.prefill_chunk
        mixed = config.mixed_prefill if config.mixed_prefill is not None else (cuda and auto_chunk)
        prefill_why = (f"{chunk}-row mixed steps" if mixed else f"chunks of {chunk} tokens" if chunk else
                       "whole prompts") + (" (the CUDA default; --exact for whole prompts)" if cuda and auto_chunk
                                           and mixed and config.mixed_prefill is None else "")
    cap = min(MAX_AUTO_BATCH, chunk // 2) if mixed else MAX_AUTO_BATCH
    g = loaded.geometry
    model = loaded.model.config
    workspace = workspace_bytes(model, g.bytes_per_token, config.max_prompt_tokens, g.dtype.itemsize, receive_slots)
    plan = plan_pool(g.bytes_per_token, model.max_position_embeddings, config.max_batch, config.max_seq_len,
                     config.kv_pool_gib, config.gpu_memory_utilization, device_memory(loaded.device), workspace, cap)
    options = EngineOptions(max_batch=plan.slots, max_seq_len=plan.max_seq, cuda_graphs=config.cuda_graphs,
                            prefill_chunk=chunk, mixed_prefill=mixed, mixed_max_rows=config.mixed_max_rows,
                            fail_scheduler_after_steps=config.fail_scheduler_after_steps,
                            prefix_cache=config.prefix_cache, host_cache_gib=config.host_cache_gib)
    line = (f"engine defaults on {loaded.device}: dtype {loaded.spec.dtype}"
            f"{' (auto)' if config.dtype == 'auto' else ''}; prefill: {prefill_why}; KV pool {plan.slots} x "
            f"{plan.max_seq} tokens x {g.bytes_per_token} B = {plan.slots * plan.max_seq * g.bytes_per_token / GIB:.2f}"
            f" GiB ({plan.why})")
    return options, line
