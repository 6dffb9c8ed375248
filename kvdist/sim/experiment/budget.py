"""What the main job will allocate, estimated from its config before anything is
built: the trace every rank generates and the tiny model's weights, against the
memory each rank has. A run that cannot fit is one line naming the key that makes it
too large (the one whose default would shrink the run the most), not minutes of
generating a trace that grows to gigabytes or a 34 GB allocation's traceback.

Also the config values the cache takes but the main job cannot use (``int8``/``uint8``
K/V: the cache stores them for engines that quantize K/V themselves; the main job's
model writes floating-point K/V and has no quantizer)."""

from __future__ import annotations

__all__ = ["NOT_FOR_THE_RUN", "Budget", "RunSize", "check_run", "model_bytes", "run_size", "trace_bytes"]

import math
from dataclasses import dataclass

from ...config import CacheConfig, WorkloadConfig
from ...layout import KVLayout

# K/V dtypes the cache stores and the main job's model cannot write.
NOT_FOR_THE_RUN = ("int8", "uint8")
REQUEST_OVERHEAD = 512  # bytes of a Request beside its tokens (the object, two arrays): 430 measured
CHAT_OVERHEAD = 128  # bytes of a live chat (workload.conversations of them at once)
TOKEN_BYTES = 4  # int32
# The keys whose values size the trace and the model, in the order they are named on a tie.
SIZING_KEYS = ("requests", "system_prompt_tokens", "system_prompts", "turns", "user_tokens", "output_tokens",
               "conversations", "hidden", "vocab_size", "ffn_hidden", "q_per_kv")


def _mean(lo_hi: tuple[int, int]) -> float:
    return (lo_hi[0] + lo_hi[1]) / 2


def trace_bytes(w: WorkloadConfig, requests: int) -> int:
    """The trace's memory, from the means of its ranges: a chat of T turns sends
    prompts of S + (k+1)·U + k·O tokens for k = 0..T-1 (system prompt, history,
    new message), each with a reply of O tokens."""
    lo, hi = w.turns
    e_t = (lo + hi) / 2

    def squares(n: int) -> int:  # 1² + ... + n²
        return n * (n + 1) * (2 * n + 1) // 6

    e_t2 = (squares(hi) - squares(lo - 1)) / (hi - lo + 1)
    s, u, o = w.system_prompt_tokens, _mean(w.user_tokens), _mean(w.output_tokens)
    per_chat = e_t * s + u * (e_t2 + e_t) / 2 + o * (e_t2 - e_t) / 2
    per_request = math.ceil(REQUEST_OVERHEAD + TOKEN_BYTES * (per_chat / e_t + o))
    return (requests * per_request + CHAT_OVERHEAD * w.conversations
            + TOKEN_BYTES * s * w.system_prompts)


def model_bytes(cfg: CacheConfig, ranks: int, itemsize: int) -> int:
    """One rank's weights at their largest (``sim.model.Decoder``): the whole
    embedding, its share of every layer, and one layer's tensor drawn at global size
    before it is sliced."""
    m, w = cfg.model, cfg.workload
    hidden, kv = w.hidden, m.num_kv_heads * m.head_dim
    ffn = w.ffn_hidden or 4 * hidden
    qkv = hidden * (w.q_per_kv + 2) * kv
    wo = w.q_per_kv * kv * hidden
    mlp = 3 * hidden * -(-ffn // ranks)
    drawn = max(hidden * (w.q_per_kv + 2) * kv * ranks, 2 * hidden * ffn)
    return itemsize * (w.vocab_size * hidden + m.num_layers * (qkv + wo + mlp) + drawn)


@dataclass(frozen=True, slots=True)
class Budget:
    """What one rank has: host memory (the trace; the model too on a CPU), and on
    CUDA the device memory the GPU tier leaves to the model."""

    host: int
    local_ranks: int
    device: int | None = None  # None: the model is in host memory
    itemsize: int = 4  # of the model's compute dtype


@dataclass(frozen=True, slots=True)
class RunSize:
    """Bytes of the trace (every rank holds it whole) and of one rank's model."""

    trace: int
    model: int

    def excess(self, budget: Budget) -> int:
        """Bytes beyond the budget, on the host or the device, whichever is more over."""
        host = self.trace + (self.model if budget.device is None else 0) - budget.host
        return max(host, self.model - budget.device) if budget.device is not None else host

    def problem(self, budget: Budget) -> str | None:
        host = self.trace + (self.model if budget.device is None else 0)
        share = f"this node has available for each of its {budget.local_ranks} rank(s)"
        if host > budget.host:
            on_host = budget.device is None
            what = f"the trace {self.trace:,}" + (f", the model {self.model:,}" if on_host else "")
            return (f"the run needs about {host:,} bytes per rank ({what}), "
                    f"more than the {budget.host:,} bytes {share}")
        if budget.device is not None and self.model > budget.device:
            return (f"the model needs about {self.model:,} bytes per rank, "
                    f"more than the {budget.device:,} bytes the GPU tier leaves on the device")
        return None


def run_size(cfg: CacheConfig, requests: int, ranks: int, itemsize: int) -> RunSize:
    """The trace of ``requests`` requests and one rank's model of ``ranks``-way TP."""
    return RunSize(trace_bytes(cfg.workload, requests), model_bytes(cfg, ranks, itemsize))


Mistake = tuple[str, object, str]  # ConfigError's key, value and why


def check_run(cfg: CacheConfig, requests: int | None, ranks: int, budget: Budget) -> Mistake | None:
    """``(key, value, why)`` of the first thing the main job cannot run with, or None.
    Pure: the caller agrees on it across ranks (their memory may differ)."""
    if cfg.model.dtype in NOT_FOR_THE_RUN:
        return ("model.dtype", cfg.model.dtype,
                "the main job's model writes floating-point K/V (the cache stores int8/uint8 for engines "
                "that quantize K/V themselves); use float16, bfloat16, float32 or a float8 dtype")
    shortest = _shortest_request(cfg)
    if shortest is not None:
        return shortest
    n = cfg.workload.requests if requests is None else requests
    why = run_size(cfg, n, ranks, budget.itemsize).problem(budget)
    if why is None:
        return None
    key = _culprit(cfg, n, ranks, budget)
    value = n if key == "requests" else getattr(cfg.workload, key)
    return (f"workload.{key}", value, why)


def _shortest_request(cfg: CacheConfig) -> Mistake | None:
    """Every chat's first request holds a system prompt, a message and a reply at
    once: if even the shortest cannot fit a GPU tier sized in blocks or bytes, no
    request can (the scheduler would say so only after the whole trace was made)."""
    gpu, tpb = cfg.cache.gpu, cfg.cache.tokens_per_block
    bpb = KVLayout.from_config(cfg).bytes_per_block
    blocks = gpu.blocks if gpu.blocks is not None else None if gpu.bytes is None else gpu.bytes // bpb
    w = cfg.workload
    parts = {"system_prompt_tokens": w.system_prompt_tokens, "user_tokens": w.user_tokens[0],
             "output_tokens": w.output_tokens[0] - 1}  # the last reply token's K/V is never written
    tokens = sum(parts.values())
    need = -(-tokens // tpb)
    if blocks is None or need <= blocks:
        return None
    key = max(parts, key=parts.__getitem__)
    return (f"workload.{key}", getattr(w, key),
            f"the shortest request ({tokens:,} tokens: a system prompt, the shortest message and reply) "
            f"needs {need:,} GPU blocks, more than the GPU tier's {blocks:,}")


def _culprit(cfg: CacheConfig, requests: int, ranks: int, budget: Budget) -> str:
    """The sizing key whose default would shrink the run the most; ``requests`` when
    no default would (then only fewer requests help)."""
    defaults = WorkloadConfig()

    def excess(key: str | None) -> int:
        n = defaults.requests if key == "requests" else requests
        c = cfg if key in (None, "requests") else cfg.model_copy(
            update={"workload": cfg.workload.model_copy(update={key: getattr(defaults, key)})})
        return run_size(c, n, ranks, budget.itemsize).excess(budget)

    best = min(SIZING_KEYS, key=excess)
    return best if excess(best) < excess(None) else "requests"
