"""Routing decisions at arrival: which replica serves a request, decided when it
arrives from what the router knows then (the replicas job in time, ``route_feed``).

- :class:`RoundRobin`: the k-th request routed goes to replica ``k mod R``.
- :class:`KvAware`: NVIDIA Dynamo's KV router cost over a prefix index fed by the
  replicas' KV events (:class:`CachedPrefixes`): for every replica,
  ``cost = overlap_score_weight * prefill_blocks + active_blocks`` where
  ``prefill_blocks`` are the prompt's blocks the replica would compute (its blocks
  less the longest prefix the replica holds in any local tier — GPU, host, disk; the
  remote tier is excluded) and ``active_blocks`` the blocks the replica's requests
  would hold with this one routed there: the router's own count over the requests
  routed there and not finished yet (added when it routes a request, taken off when
  the replica reports it finished), a prompt block that several of them share counted
  once, as Dynamo's ``ActiveSequences`` counts unique block hashes (the replica's
  prefix cache holds it once). The cheapest replica wins; ties go to the lower load,
  then the lower index (Dynamo's temperature 0: deterministic). Dynamo documents the
  cost in its router design (https://docs.nvidia.com/dynamo/design-docs/router-design:
  "potential prefill blocks" and "potential active blocks", weighted by
  ``--kv-overlap-score-weight``, default 1.0). Dynamo's prefill blocks also count the
  prompt tokens routed to the replica and not prefilled yet; that term is left out.
  With it (replicas reporting each step's prefills; README "Replicas in time" has the
  runs), at the weights of ``configs/replicas.yaml`` and ``configs/h200-replicas.yaml``
  a queued prompt outweighed most cached prefixes: 35 of 600 requests routed away
  from a longer one instead of 1-6, and the prefill computed rose.
- :class:`OneReplica`: everything to replica 0 (the one-cache ceiling in time).

A policy is called from one thread (the router's); it keeps no clock of its own."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from ..engine.request import Request

__all__ = ["CachedPrefixes", "KvAware", "OneReplica", "Policy", "RoundRobin"]


class CachedPrefixes(Protocol):
    """What the router knows of the replicas' caches (from their KV events)."""

    def longest_prefix(self, replica: int, hashes: Sequence) -> int:
        """Leading blocks of ``hashes`` (a chain) that ``replica`` holds in any local tier."""
        ...


class Policy(Protocol):
    def choose(self, req: Request) -> int:
        """The replica that serves ``req`` (called once per request, in routing order)."""
        ...

    def finished(self, rid: int) -> None:
        """The replica that served ``rid`` reported it finished."""
        ...

    def stats(self) -> dict[str, int]:
        """The policy's own figures over the run."""
        ...


class RoundRobin:
    def __init__(self, replicas: int):
        assert replicas > 0, f"{replicas} replicas"
        self.replicas, self._k = replicas, 0

    def choose(self, req: Request) -> int:
        k, self._k = self._k % self.replicas, self._k + 1
        return k

    def finished(self, rid: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


class OneReplica:
    """The whole trace to replica 0."""

    def choose(self, req: Request) -> int:
        return 0

    def finished(self, rid: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


class KvAware:
    """Dynamo's KV-router cost (module docstring). ``hashes(prompt)``: the prompt's
    full blocks' hashes as the replicas' events name them.

    Per replica the router keeps ``_refs``: for each prompt block of the requests
    routed there and not finished, how many of them hold it; and ``_own_blocks``: those
    requests' own blocks (``_own``), summed. ``active`` is derived from the two."""

    def __init__(self, replicas: int, index: CachedPrefixes, hashes: Callable[[Request], Sequence],
                 tokens_per_block: int, overlap_weight: float = 1.0):
        assert replicas > 0 and overlap_weight >= 0, (replicas, overlap_weight)
        self.replicas, self.index, self.hashes = replicas, index, hashes
        self.tpb, self.weight = tokens_per_block, overlap_weight
        self._refs: list[dict[int, int]] = [{} for _ in range(replicas)]  # prompt block hash -> requests
        self._own_blocks = [0] * replicas
        self._held: dict[int, tuple[int, Sequence, int]] = {}  # request id -> (replica, hashes, own blocks)
        self.overlap_blocks = 0  # blocks the chosen replicas held, over every decision
        # Decisions where load outweighed a longer prefix another replica held: how many,
        # and the blocks the chosen replicas held fewer than the best one (they compute them).
        self.routed_away = self.away_blocks = 0

    @property
    def active(self) -> list[int]:
        """The blocks the requests routed to each replica and not finished hold: each
        prompt block once, plus every request's own."""
        return [len(refs) + own for refs, own in zip(self._refs, self._own_blocks)]

    def _own(self, req: Request, keys: Sequence) -> int:
        """The blocks ``req`` holds that no other request shares: all but its full
        prompt blocks (the partial one and the reply's)."""
        return req.blocks_needed(self.tpb) - len(keys)

    def costs(self, req: Request) -> list[tuple[float, int]]:
        """``(cost, overlap blocks)`` of every replica for ``req``."""
        keys = self.hashes(req)
        return self._costs(req, keys, self._own(req, keys))

    def _costs(self, req: Request, keys: Sequence, own: int) -> list[tuple[float, int]]:
        """``costs`` of ``req``, its hashes ``keys`` and its ``own`` blocks given."""
        blocks = -(-len(req.prompt) // self.tpb)
        active = self.active
        out = []
        for k in range(self.replicas):
            overlap = self.index.longest_prefix(k, keys)
            refs = self._refs[k]
            added = own + sum(1 for h in keys if h not in refs)  # the blocks routing it here adds
            out.append((self.weight * (blocks - overlap) + active[k] + added, overlap))
        return out

    def choose(self, req: Request) -> int:
        keys = self.hashes(req)
        own = self._own(req, keys)
        costs = self._costs(req, keys, own)
        active = self.active
        best = min(range(self.replicas), key=lambda k: (costs[k][0], active[k], k))
        refs = self._refs[best]
        for h in keys:
            refs[h] = refs.get(h, 0) + 1
        self._own_blocks[best] += own
        self._held[req.rid] = (best, keys, own)
        held, most = costs[best][1], max(c[1] for c in costs)
        self.overlap_blocks += held
        if held < most:
            self.routed_away += 1
            self.away_blocks += most - held
        return best

    def finished(self, rid: int) -> None:
        replica, keys, own = self._held.pop(rid)
        refs = self._refs[replica]
        for h in keys:
            if refs[h] == 1:
                del refs[h]
            else:
                refs[h] -= 1
        self._own_blocks[replica] -= own

    def check_invariants(self) -> None:
        for k in range(self.replicas):
            mine = [(keys, own) for r, keys, own in self._held.values() if r == k]
            counts = Counter(h for keys, _ in mine for h in keys)
            assert self._refs[k] == counts, f"replica {k}: block counts {self._refs[k]} != {counts}"
            own = sum(o for _, o in mine)
            assert self._own_blocks[k] == own, f"replica {k}: {self._own_blocks[k]} own blocks for {own}"

    def stats(self) -> dict[str, int]:
        """``overlap_blocks``: cached prefix blocks on the replicas chosen, summed;
        ``routed_away``: requests sent where fewer of their blocks were cached than on
        another replica (the load term outweighed the difference), ``away_blocks``: those
        differences, summed."""
        return {"overlap_blocks": self.overlap_blocks, "routed_away": self.routed_away,
                "away_blocks": self.away_blocks}
