"""The router in front of data-parallel replicas: which replica serves each request.

Routing is a pure function of the trace (``workload.routing``), computed up front and
identical on every rank, so routing costs no messages between replicas:

- ``round_robin``: the k-th arriving request goes to replica ``k mod R``. A chat's
  turns are spread over the replicas: its next turn usually lands where its history
  is not — the hard case for isolated replicas, the one the remote tier is for.
- ``sticky``: a chat's turns all go to one replica (new chats round-robin): history
  stays local; only system prompts are computed once per replica.
- ``prefix``: the replica that was sent the longest prefix of the prompt in whole
  blocks (the router's own record of what it sent; it does not know what the
  replica's cache evicted), ties to the replica with fewer prompt tokens routed so far.
  Chats then stick to a replica, and new chats follow their system prompt."""

from __future__ import annotations

import numpy as np

from .workload import Trace, block_keys

ROUTINGS = ("round_robin", "sticky", "prefix")


def route(trace: Trace, replicas: int, routing: str, tokens_per_block: int) -> np.ndarray:
    """``replica[i]`` serves ``trace.requests[i]``; int array of ``len(trace.requests)``."""
    assert replicas > 0, f"{replicas} replicas"
    assert routing in ROUTINGS, f"unknown routing {routing!r}; one of {ROUTINGS}"
    reqs = trace.requests
    if routing == "round_robin":
        return np.arange(len(reqs)) % replicas
    out = np.empty(len(reqs), dtype=np.int64)
    if routing == "sticky":
        home: dict[int, int] = {}
        for i, r in enumerate(reqs):
            out[i] = home.setdefault(r.chat, len(home) % replicas)
        return out
    sent: list[set[bytes]] = [set() for _ in range(replicas)]
    load = np.zeros(replicas, dtype=np.int64)
    for i, r in enumerate(reqs):
        keys = block_keys(r.prompt, tokens_per_block)
        matched = [_known_prefix(keys, s) for s in sent]
        best = max(range(replicas), key=lambda k: (matched[k], -load[k], -k))
        out[i] = best
        sent[best].update(keys)
        load[best] += len(r.prompt)
    return out


def _known_prefix(keys: list[bytes], known: set[bytes]) -> int:
    """Leading blocks of ``keys`` in ``known`` (a chained key implies its parents)."""
    lo, hi = 0, len(keys)
    while lo < hi:  # binary search: known prefixes are closed under taking parents
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in known:
            lo = mid
        else:
            hi = mid - 1
    return lo


def split(trace: Trace, routes: np.ndarray, replica: int) -> Trace:
    """The share of ``trace`` that ``routes`` sends to ``replica``."""
    return trace.subset({r.rid for r, k in zip(trace.requests, routes) if k == replica})
