"""The serve run's configuration: what `kvtransfer-bench serve` sends, checked once.

Why apart from the run (bench/runs/serve.py): the multi-turn run (serve_multiturn.py) builds on the same
config, and neither imports the other's run.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from bench.measure import openai_stream
from decode_server.client import MODES
from kvtransfer.model.spec import load_config

MAX_PROMPTS = 100_000


def is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0].strip("[]") if ":" in addr else addr
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeConfig:
    addr: str = "127.0.0.1:50051"
    num_prompts: int = 100
    concurrency: int | None = None     # most requests in flight (None: no limit, as vLLM's --max-concurrency)
    request_rate: float = math.inf     # Poisson arrivals per second (inf: all at once)
    input_len: int = 128
    input_len_range: float = 0.0       # r: lengths uniform in [len*(1-r), len*(1+r)] (vLLM's --random-range-ratio)
    output_len: int = 16
    vocab_size: int | None = None      # token ids uniform in [0, vocab); None: the --model preset's vocabulary
    model: str | None = None
    mode: str = "auto"
    warmup: int = 1                    # sequential requests before the clock starts (not counted)
    seed: int = 0
    timeout_s: float = 120.0           # per request
    server_metrics: str = ""           # the decode server's /metrics URL: report its batch size over the run
    max_duration_s: float = 600.0      # the whole run
    long_share: float = 0.0            # this fraction of the prompts is long instead (a prefill that stalls decode)
    long_len: tuple[int, int] = (16384, 32768)  # a long prompt's length: uniform in [lo, hi]
    api: str = ""                      # the OpenAI front's base URL (api_server/); empty: the gRPC door at addr
    temperature: float = 0.0           # > 0: every request samples (with top_p; the server draws each seed)
    top_p: float = 1.0
    shared_prefix: int = 0             # every prompt opens with one opening of this many ids (then its own input_len)
    memory_pressure: float = 0.0       # > 0: concurrency sized to this many times the server's KV pool (its Info)
    stop_after: tuple[int, int] | None = None  # the client ends each request after uniform [lo, hi] tokens

    def __post_init__(self):
        if not is_loopback(self.addr):
            raise ValueError(f"--addr {self.addr!r}: serve only targets loopback servers (127.0.0.1, ::1, localhost)")
        if self.api and not (self.api.startswith("http") and openai_stream.is_loopback_url(self.api)):
            raise ValueError(f"--api {self.api!r}: an http(s) URL of a loopback server, e.g. http://127.0.0.1:8000")
        if self.api and self.mode != "auto":
            raise ValueError("--mode is the gRPC request's; the OpenAI front sends AUTO: drop --mode or --api")
        if not 1 <= self.num_prompts <= MAX_PROMPTS:
            raise ValueError(f"num prompts must be 1..{MAX_PROMPTS}")
        if self.concurrency is not None and self.concurrency < 1 or not self.request_rate > 0:
            raise ValueError("concurrency must be >= 1 and request rate > 0")
        if self.input_len < 1 or self.output_len < 1 or not 0 <= self.input_len_range < 1:
            raise ValueError("input and output lengths must be >= 1 and the range ratio in [0, 1)")
        if self.vocab_size is None and self.model is None:
            raise ValueError("add --model with the server's --model (a preset such as qwen2.5-7b or tiny, or its "
                             "local dir), or --vocab-size N: the token ids must stay in the server's vocabulary")
        if (self.vocab_size or 1) < 1 or self.mode not in MODES or self.warmup < 0:
            raise ValueError(f"vocab size >= 1, warmup >= 0, mode one of {', '.join(MODES)}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0) or not 0 < self.top_p <= 1:
            raise ValueError(f"--temperature must be finite and >= 0 (0: greedy) and --top-p in (0, 1] (got "
                             f"{self.temperature:g} and {self.top_p:g})")
        if self.shared_prefix < 0 or not (math.isfinite(self.memory_pressure) and self.memory_pressure >= 0):
            raise ValueError(f"--shared-prefix must be >= 0 and --memory-pressure finite and >= 0 (got "
                             f"{self.shared_prefix} and {self.memory_pressure:g})")
        if self.memory_pressure and self.api:
            raise ValueError("--memory-pressure reads the decode server's pool over gRPC (--addr): drop --api")
        if self.stop_after is not None and not 1 <= self.stop_after[0] <= self.stop_after[1] <= self.output_len:
            raise ValueError(f"--stop-after LO,HI needs 1 <= LO <= HI <= --output-len ({self.output_len}); got "
                             f"{self.stop_after[0]},{self.stop_after[1]}")
        if self.stop_after is not None and self.api:
            raise ValueError("--stop-after cancels gRPC streams (--addr): drop --api")
        if self.timeout_s <= 0 or self.max_duration_s <= 0:
            raise ValueError("timeouts must be > 0")
        if not 0 <= self.long_share <= 1 or not 1 <= self.long_len[0] <= self.long_len[1]:
            raise ValueError(f"--long-share must be in [0, 1] and --long-len-range LO,HI with 1 <= LO <= HI "
                             f"(got {self.long_share:g} and {self.long_len[0]},{self.long_len[1]})")
        short_max = self.short_lengths()[1]
        if self.long_share > 0 and short_max >= self.long_len[0]:  # the split by length would mix them up
            raise ValueError(f"--long-len-range starts at {self.long_len[0]}, within the other prompts' lengths "
                             f"(up to {short_max}): start it above")
        model = load_config(self.model) if self.model is not None else None
        if self.vocab_size is None:  # recorded in the result: the vocabulary the ids were drawn from
            object.__setattr__(self, "vocab_size", model.vocab_size)
        longest = max(short_max, self.long_len[1] if self.long_share > 0 else 0) + self.shared_prefix + self.output_len
        context = getattr(model, "max_position_embeddings", None)
        if context is not None and longest > context:
            raise ValueError(f"the longest prompt plus --output-len is {longest} tokens, over {self.model}'s context "
                             f"of {context}: shorten --input-len/--long-len-range or --output-len")

    def short_lengths(self) -> tuple[int, int]:
        """(lo, hi) of the other prompts' lengths: input_len x [1 - r, 1 + r], at least 1."""
        lo = max(1, math.floor(self.input_len * (1 - self.input_len_range)))
        return lo, max(lo, math.ceil(self.input_len * (1 + self.input_len_range)))
