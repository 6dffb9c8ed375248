"""The synthetic serving trace: shared system prompts, multi-turn chats that resend
their whole history, Poisson arrivals — counted in scheduler steps (``arrival``,
``workload.arrival_rate`` per step) and, for runs in real time, in seconds
(``arrival_s``, ``workload.request_rate`` per second, from a stream of its own so
the rest of the trace does not depend on it).

The trace is generated up front from ``workload.seed`` and is identical on every
rank and in every replay. The model's replies are scripted by the trace (the
simulated model decodes exactly these tokens), so the next turn of a chat — its
history plus the reply plus a new user message — is known before the run starts,
and the same trace can be replayed through bookkeeping-only caches (no model) to
compare reuse policies on exactly the same requests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from ...config import WorkloadConfig
from ..engine.request import Request


@dataclass(slots=True)
class Trace:
    requests: list[Request]
    system_prompts: list[np.ndarray]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    def distinct_blocks(self, tokens_per_block: int) -> int:
        """Distinct full KV blocks the trace writes (prompts and decoded tokens): the
        working set a cache would need to reuse everything reusable."""
        seen: set[bytes] = set()
        for r in self.requests:
            seen.update(block_keys(np.concatenate([r.prompt, r.output[:-1]]), tokens_per_block))
        return len(seen)

    def subset(self, rids: set[int]) -> Trace:
        """The requests whose ids are in ``rids`` (a replica's share), in arrival order."""
        return Trace([r for r in self.requests if r.rid in rids], self.system_prompts)


def block_keys(tokens: np.ndarray, tokens_per_block: int) -> list[bytes]:
    """The prefix key of every full block of ``tokens``: a chain of xxh3-128 over the
    block's int32 tokens and its parent's key (a block is known by its whole prefix)."""
    toks = np.asarray(tokens, dtype=np.int32)
    tpb = tokens_per_block
    keys: list[bytes] = []
    parent = b""
    for i in range(len(toks) // tpb):
        parent = xxhash.xxh3_128_digest(parent + toks[i * tpb:(i + 1) * tpb].tobytes())
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Chat:
    chat_id: int
    history: np.ndarray
    turns_left: int
    last_rid: int = -1
    ready_at: int = 0  # first step its next turn may arrive (workload.think_steps)


def generate(w: WorkloadConfig) -> Trace:
    """The trace of ``w.requests`` requests; a pure function of ``w``."""
    rng = np.random.default_rng(w.seed)
    vocab = w.vocab_size

    def tokens(lo_hi: tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(lo_hi[0], lo_hi[1] + 1))
        return rng.integers(0, vocab, n, dtype=np.int32)

    systems = [rng.integers(0, vocab, w.system_prompt_tokens, dtype=np.int32)
               for _ in range(w.system_prompts)]
    next_chat = 0

    def new_chat() -> _Chat:
        nonlocal next_chat
        system = systems[int(rng.integers(len(systems)))]
        chat = _Chat(next_chat, system, int(rng.integers(w.turns[0], w.turns[1] + 1)))
        next_chat += 1
        return chat

    live = [new_chat() for _ in range(w.conversations)]
    requests: list[Request] = []
    step, due = 0, int(rng.poisson(w.arrival_rate))
    for rid in range(w.requests):
        while due == 0:
            step += 1
            due = int(rng.poisson(w.arrival_rate))
        due -= 1
        ready = [i for i, c in enumerate(live) if c.ready_at <= step]
        if not ready:  # every live chat is reading its last reply: the arrival waits for the first
            step = min(c.ready_at for c in live)
            ready = [i for i, c in enumerate(live) if c.ready_at <= step]
        k = ready[int(rng.integers(len(ready)))]
        chat = live[k]
        prompt = np.concatenate([chat.history, tokens(w.user_tokens)])
        output = tokens(w.output_tokens)
        turn = 0 if chat.last_rid < 0 else requests[chat.last_rid].turn + 1
        requests.append(Request(rid, chat.chat_id, turn, step, prompt, output, chat.last_rid))
        chat.history = np.concatenate([prompt, output])
        chat.last_rid = rid
        chat.turns_left -= 1
        if w.think_steps:  # the reply takes len(output) steps at best, then the user thinks
            chat.ready_at = step + len(output) + w.think_steps
        if chat.turns_left == 0:
            live[k] = new_chat()
    gaps = np.random.default_rng([w.seed, 1]).exponential(1.0 / w.request_rate, len(requests))
    for r, t in zip(requests, np.cumsum(gaps).tolist()):
        r.arrival_s = t
    return Trace(requests, systems)
