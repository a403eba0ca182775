"""What the decode engine's `auto` flags become on the device at hand: dtype, prefill shape, KV pool.

Why here, once, after the weights are loaded: a user compares servers by starting them with no tuning
flags, so the defaults must be the configuration that measured fastest, sized to the device they find.
- dtype `auto` (kvtransfer.model.loaded.resolve_dtype): bfloat16 on CUDA, float32 on CPU.
- Prefill on CUDA: mixed steps of up to 512 rows (prompt chunks ride in the decode steps' forward; a step
  with less prompt work takes a smaller size), the measured fastest serving configuration, with up to 256
  rows decoding; on CPU the whole prompt at once. Chunked and mixed prefill give up
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
FAST_PREFILL_CHUNK = 512  # rows of a mixed step (decode rows included), its token budget: measured (README)
MAX_AUTO_BATCH = 256  # auto rows stop here: a mixed step of 512 rows needs >= 2 per decode row; graphs per bucket
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


def attention_partials_bytes(config, rows: int, max_seq: int) -> int:
    """The decode attention's split partials at their peak (kvtransfer/kernels/triton_attention.py: one layer's
    (rows, Hq, splits, D + 1) fp32, reused from layer to layer in the graphs' pool), with the splits its per-split cap
    makes in rows of `max_seq` positions (triton_attention.capped_splits). 0 without Triton."""
    try:
        from kvtransfer.kernels.triton_attention import capped_splits
    except ImportError:  # no Triton: the torch reference ops keep no partials
        return 0
    hq = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    splits, _ = capped_splits(max_seq, 1)  # one split by count: many rows, where the bytes peak
    return rows * hq * splits * (head_dim + 1) * 4


@dataclass(frozen=True)
class PoolPlan:
    slots: int
    max_seq: int
    why: str
    page: int = 0  # positions per block (0: the slot layout, a block of max_seq per slot)
    blocks: int = 0  # blocks in the pool (paged)


def pool_budget(kv_pool_gib: float, utilization: float, memory: Memory | None, workspace: int) -> tuple[int, str]:
    """(bytes the KV pool may take, where that figure comes from); (0, "") on CPU with nothing said."""
    if kv_pool_gib:
        return int(kv_pool_gib * GIB), f"--kv-pool-gib {kv_pool_gib:g}"
    if memory is None:
        return 0, ""
    allowed = int(utilization * memory.total) - memory.ours - workspace
    budget = min(allowed, memory.free - workspace)
    return budget, (f"{utilization:g} of {memory.total / GIB:.1f} GiB (--gpu-memory-utilization) less "
                    f"{memory.ours / GIB:.1f} GiB of weights and {workspace / GIB:.1f} GiB of workspace"
                    + (f", capped by {memory.free / GIB:.1f} GiB free now" if budget < allowed else ""))


def plan_blocks(bytes_per_token: int, context: int, page: int, max_batch: int, max_seq_len: int, budget: int,
                source: str, batch_cap: int, pool_given: bool = False) -> PoolPlan:
    """The paged pool: as many blocks of `page` tokens as the budget holds (CPU with nothing said: the memory of
    CPU_SLOTS x CPU_SEQ tokens), `max_batch` rows (0: `batch_cap`, CPU_SLOTS on CPU), a request's context up to
    --max-seq-len (0: the model's, CPU_SEQ at most on CPU) and never more than the pool."""
    cpu = not source
    tokens = CPU_SLOTS * CPU_SEQ if cpu else budget // bytes_per_token
    if max_batch and not cpu and not pool_given:  # rows given: no more than they can fill (another server may share
        # the GPU, as the fixed slots of --max-batch x the context left it)
        tokens = min(tokens, max_batch * (max_seq_len or context))
        source += f", at most --max-batch {max_batch} x {max_seq_len or context} tokens"
    page = min(page, max_seq_len or context)  # a block never outgrows the context a row can hold
    blocks = tokens // page
    if blocks < 1:
        raise ValueError(f"no room for a KV pool: {source} leaves {max(budget, 0) / GIB:.2f} GiB, not one block of "
                         f"{page} tokens; raise --gpu-memory-utilization, pass --kv-pool-gib, or use a smaller "
                         "model or --max-prompt-tokens")
    rows = max_batch or (CPU_SLOTS if cpu else batch_cap)
    seq = min(max_seq_len or min(context, CPU_SEQ if cpu else context), blocks * page)
    return PoolPlan(rows, seq, f"{source or 'CPU default'}: {blocks} blocks of {page} tokens ({blocks * page} "
                    f"tokens), {rows} rows, contexts up to {seq} tokens", page, blocks)


def plan_pool(bytes_per_token: int, context: int, max_batch: int, max_seq_len: int, kv_pool_gib: float,
              utilization: float, memory: Memory | None, workspace: int, batch_cap: int) -> PoolPlan:
    """Slots x tokens of the KV pool. 0 for max_batch / max_seq_len / kv_pool_gib means "choose"."""
    budget, source = pool_budget(kv_pool_gib, utilization, memory, workspace)
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
    if tokens < seq:  # not one slot of the context asked for: one anyway would overrun the budget
        raise ValueError(f"no room for one slot of --max-seq-len {seq} tokens: {source} leaves "
                         f"{max(budget, 0) / GIB:.2f} GiB, {tokens} tokens; lower --max-seq-len, raise "
                         "--gpu-memory-utilization or --kv-pool-gib, or use the paged pool (--kv-block-tokens)")
    slots = min(batch_cap, tokens // seq)
    capped = " (the cap)" if slots == batch_cap and tokens // seq > batch_cap else ""
    return PoolPlan(slots, seq, f"{source}: {slots} slots{capped} of {seq} tokens"
                    + ("" if max_seq_len else " (the model's context)" if seq == context else " (all the pool holds)"))


def plan_engine(config, loaded, receive_slots: int):
    """EngineOptions for `config` on `loaded`'s device, and the one log line saying what was chosen and why.
    `receive_slots`: longest-prompt caches the data plane may hold on the device (0 colocated)."""
    from kvtransfer.engine.engine import EngineOptions

    check_max_seq_len(config.max_seq_len, loaded.model.config.max_position_embeddings)
    cuda = loaded.device.type == "cuda"
    if config.exact:
        chunk, mixed, prefill_why = 0, False, "whole prompts (--exact)"
    elif config.batch_invariant:  # the prompt's rows in the steps, each as a decode row (runner.py)
        chunk, mixed = config.prefill_chunk if config.prefill_chunk > 0 else FAST_PREFILL_CHUNK, True
        prefill_why = f"in the decode steps, up to {chunk} rows each, every row as a decode row (--batch-invariant)"
    else:
        auto_chunk = config.prefill_chunk < 0
        chunk = (FAST_PREFILL_CHUNK if cuda or config.mixed_prefill else 0) if auto_chunk else config.prefill_chunk
        mixed = config.mixed_prefill if config.mixed_prefill is not None else (cuda and auto_chunk)
        prefill_why = (f"mixed steps of up to {chunk} rows" if mixed else f"chunks of {chunk} tokens" if chunk else
                       "whole prompts") + (" (the CUDA default; --exact for whole prompts)" if cuda and auto_chunk
                                           and mixed and config.mixed_prefill is None else "")
        if cuda and chunk and not mixed and config.mixed_prefill is None:  # measured far slower: say how to get steps
            prefill_why += (f" between decode steps (an explicit --prefill-chunk turns the mixed steps off on CUDA; "
                            f"--mixed-prefill makes them steps of up to {chunk} rows)")
    cap = min(MAX_AUTO_BATCH, chunk // 2) if mixed else MAX_AUTO_BATCH
    g = loaded.geometry
    model = loaded.model.config
    workspace = workspace_bytes(model, g.bytes_per_token, config.max_prompt_tokens, g.dtype.itemsize, receive_slots)
    memory, context = device_memory(loaded.device), model.max_position_embeddings
    if cuda:  # the decode attention's split partials, for the most rows and the longest rows the pool may get
        workspace += attention_partials_bytes(model, max(config.max_batch, cap), config.max_seq_len or context)
    if config.kv_block_tokens:
        plan = plan_blocks(g.bytes_per_token, context, config.kv_block_tokens, config.max_batch, config.max_seq_len,
                           *pool_budget(config.kv_pool_gib, config.gpu_memory_utilization, memory, workspace), cap,
                           pool_given=bool(config.kv_pool_gib))
    else:
        plan = plan_pool(g.bytes_per_token, context, config.max_batch, config.max_seq_len, config.kv_pool_gib,
                         config.gpu_memory_utilization, memory, workspace, cap)
    options = EngineOptions(max_batch=plan.slots, max_seq_len=plan.max_seq, cuda_graphs=config.cuda_graphs,
                            gemv=config.gemv, batch_invariant=config.batch_invariant,
                            prefill_chunk=chunk, mixed_prefill=mixed, mixed_max_rows=config.mixed_max_rows,
                            fail_scheduler_after_steps=config.fail_scheduler_after_steps,
                            prefix_cache=config.prefix_cache, host_cache_gib=config.host_cache_gib,
                            kv_block_tokens=plan.page, kv_blocks=plan.blocks)
    tokens = plan.blocks * plan.page if plan.page else plan.slots * plan.max_seq
    pool = (f"{plan.blocks} blocks of {plan.page} tokens, {plan.slots} rows" if plan.page else
            f"{plan.slots} x {plan.max_seq} tokens")
    line = (f"engine defaults on {loaded.device}: dtype {loaded.spec.dtype}"
            f"{' (auto)' if config.dtype == 'auto' else ''}; prefill: {prefill_why}; KV pool {pool} x "
            f"{g.bytes_per_token} B/token = {tokens * g.bytes_per_token / GIB:.2f} GiB ({plan.why})")
    return options, line


def check_max_seq_len(max_seq_len: int, context: int) -> None:
    """A slot longer than the model's context holds memory no request can use (prompt + max_new_tokens must fit
    the context too): refused at start, before the pool is allocated."""
    if max_seq_len > context:
        raise ValueError(f"--max-seq-len {max_seq_len} is over the model's context of {context} tokens "
                         f"(max_position_embeddings): give at most {context}, or 0 for the model's context")
