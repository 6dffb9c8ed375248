"""The remote tier under ``cache.gpu: external``: one worker rank's share of the other
replicas' host tiers (docs/design.md, "An engine-owned GPU tier", its remote tier;
rules R1-R4 of "Remote tier").

Every TP rank runs its own planner (vLLM's ``external_launcher``: the scheduler in the
worker's process), which asks this tier ``holders`` of a prompt's blocks after the
replica's own run (``ExternalPlanner.lookup`` / ``plan_load``) and ships the blocks to
load as ``Fetch`` records with the step's copies.

* As a *holder* (the ``HostSlots`` the holder's side reads): the planner's saves name
  the host slots they fill and the hash each then holds (``Transfers.filled``). ``filled``
  makes the slot's stamp odd before the copy into it is issued (R2's writer); every
  ``every`` steps ``end_step`` stamps valid the slots whose copy completed and sends the
  changes to the same TP rank of every other replica (``HostChanges``), and the message
  server answers the peers' fetch requests out of the host tier.
* As a *fetcher*: ``fetch`` lands a ``Fetch``'s blocks in rows of a private landing
  area through the transport of their holder (a copy out of a node peer's shared host
  tier, ``SharedTransport``; MPI messages between nodes, ``MessageTransport``), each
  checked against the holder's stamps around the copy (R2: a stale entry is a miss).
  Blocks beyond the free landing rows are given up (the engine recomputes them).
* At every step boundary, on every TP rank (``end_step``): one MIN-reduce inside the TP
  group carries the directory message counts (R4: all apply the same prefix) and, for
  every fetch in flight, in the order the planners started them, which blocks this
  rank has resolved and which it has whole. A fetch is decided once every rank has
  resolved all its blocks: the blocks every rank has whole are copied into the engine's
  blocks, the others are failed on every rank (R1: the engine recomputes a block no
  rank of the replica loaded). ``decided`` hands them to ``ExternalCache``.

Nothing after start-up is collective across replicas (R3); a fetch waits at most
``fetch_timeout_ms``. State: ``_hi``/``_lo``/``_cached`` per host slot (what the
planner's saves put there); ``_free`` the free landing rows; ``_jobs`` the fetches in
flight, in start order (equal on the TP ranks); ``_draining`` batches given up whose
copies may still write their rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..blocks import HOST
from ..distributed.directory import Directory, encode
from ..distributed.directory_channel import DirectoryChannel
from ..distributed.host_changes import HostChanges
from ..distributed.message_server import MessageServer
from ..distributed.stamps import SlotStamps
from ..distributed.transport import DONE, LANDED, PENDING, Batch, Fetcher
from ..prefix import MASK64
from .plan import Fetch

__all__ = ["Fetched", "PeerTier"]


@dataclass(frozen=True, slots=True)
class Fetched:
    """A fetch the TP group decided: ``rows`` of the landing area hold the blocks for
    engine blocks ``blocks`` (every rank has them whole); ``failed`` engine blocks were
    not loaded on some rank (the engine recomputes them)."""

    request_id: Hashable
    rows: np.ndarray
    blocks: np.ndarray
    failed: tuple[int, ...]


@dataclass(slots=True, eq=False)
class _Job:
    """One request's fetch in flight: its batches, and per batch the engine blocks."""

    request_id: Hashable
    batches: list[Batch]
    blocks: list[np.ndarray]
    norow: np.ndarray  # engine blocks that found no landing row: given up here

    def states(self) -> np.ndarray:
        """This rank's outcome bits of every block: the batches', then the ones with no row."""
        return np.concatenate([*(b.state for b in self.batches), np.full(len(self.norow), DONE, np.uint8)])


class PeerTier:
    """One worker rank's remote tier (see the module docstring). Built by
    ``kvdist.external.peers_setup.commit_peers``; driven by ``ExternalCache``."""

    def __init__(self, *, tp, replica: int, stamps: SlotStamps, channel: DirectoryChannel,
                 directory: Directory, transports: dict[int, Fetcher], server: MessageServer,
                 landing: torch.Tensor, fetch_timeout_s: float, every: int, host_slots: int,
                 serve: bool = True):
        self.tp, self.replica = tp, replica
        self.stamps, self.channel, self.directory = stamps, channel, directory
        self.transports, self.server, self.serve = transports, server, serve
        self.landing = landing  # uint8 [rows, bytes_per_block], this rank's alone
        self.timeout_s, self.every = fetch_timeout_s, every
        self._hi = np.zeros(host_slots, dtype=np.uint64)
        self._lo = np.zeros(host_slots, dtype=np.uint64)
        self._cached = np.zeros(host_slots, dtype=bool)
        self._pending: Callable[[np.ndarray], np.ndarray] = lambda s: np.zeros(len(s), dtype=bool)
        self.host = HostChanges(stamps, self, channel)
        self._free: list[int] = list(range(landing.shape[0]))[::-1]
        self._jobs: list[_Job] = []
        self._draining: list[Batch] = []
        self._decided: list[Fetched] = []
        self._fetchers = list({id(t): t for t in transports.values()}.values())
        self.steps = 0
        self.counters = {"fetches": 0, "blocks_requested": 0, "blocks_landed": 0, "blocks_failed": 0,
                         "no_landing_row": 0}

    # -- the holder's side (HostSlots, local host slots) ----------------------------------------
    def watch(self, writes_pending: Callable[[np.ndarray], np.ndarray]) -> None:
        """Where ``publish`` learns whether copies into host slots are still running
        (the worker's transfer engine, once the engine's tensors are registered)."""
        self._pending = writes_pending

    def tier_base(self, tier: int) -> int:
        return 0  # local slots: the host tier's, and the landing area's rows

    def cached(self, slots: np.ndarray) -> np.ndarray:
        return self._cached[slots]

    def stamps_of(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._hi[slots], self._lo[slots]

    def writes_pending(self, slots) -> np.ndarray:
        return self._pending(np.asarray(slots, dtype=np.int64))

    def pending_events(self, slots) -> list:
        """Landing rows: nothing else copies into them (a row is free again only once
        its block was copied into the engine's, synchronously, or its copy is done)."""
        return []

    def filled(self, slot: int, h: int) -> None:
        """A save is about to copy the block of hash ``h`` into host ``slot``: the slot's
        stamp goes odd now, before the copy is issued (R2), valid again at a publish
        after the copy completed."""
        self._hi[slot], self._lo[slot], self._cached[slot] = h >> 64, h & MASK64, True
        self.host.host_changed([], [slot])

    # -- the planner's lookups (PeerLookup) -----------------------------------------------------------
    def holders(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(replica, its host slot) of the longest run of leading ``hashes`` another
        replica holds, as the directory stands since the last agreement (R4)."""
        d = self.directory
        return [d.holder(g) for g in d.match(hashes)]

    # -- fetching -----------------------------------------------------------------------------------
    def fetch(self, request_id: Hashable, f: Fetch) -> None:
        """Start fetching ``f``'s blocks into landing rows (one batch per holder). Blocks
        that find no free row are given up here, and decided with the others (a rank's
        free rows depend on when its given-up copies finished: R1 needs the agreement)."""
        n = min(len(f.blocks), len(self._free))
        rows = np.array([self._free.pop() for _ in range(n)], dtype=np.int64)
        peers = np.asarray(f.peers[:n], dtype=np.int64)
        slots = np.asarray(f.slots[:n], dtype=np.int64)
        hi = np.array([h >> 64 for h in f.hashes[:n]], dtype=np.uint64)
        lo = np.array([h & MASK64 for h in f.hashes[:n]], dtype=np.uint64)
        blocks = np.asarray(f.blocks[:n], dtype=np.int64)
        deadline = time.monotonic() + self.timeout_s
        job = _Job(request_id, [], [], np.asarray(f.blocks[n:], dtype=np.int64))
        for peer in dict.fromkeys(peers.tolist()):
            mine = peers == peer
            b = Batch(peer, slots[mine], hi[mine], lo[mine], rows[mine], HOST, deadline, request_id)
            self.transports[peer].start(b)
            job.batches.append(b)
            job.blocks.append(blocks[mine])
        self._jobs.append(job)
        self.counters["fetches"] += 1
        self.counters["blocks_requested"] += n
        self.counters["no_landing_row"] += len(f.blocks) - n

    def service(self) -> None:
        """Answer peers, move the transports on, poll every batch (never blocks)."""
        if self.serve:
            self.server.service()
        for f in self._fetchers:
            f.progress()
        self.channel.poll()
        now = time.monotonic()
        for b in (*(b for j in self._jobs for b in j.batches), *self._draining):
            self.transports[b.peer].poll(b, now)
        self._drained()

    @property
    def fetching(self) -> bool:
        return bool(self._jobs)

    # -- the step boundary ----------------------------------------------------------------------------
    def end_step(self) -> None:
        """Every TP rank, every step: publish and send the host tier's changes every
        ``every`` steps; agree (one MIN-reduce in the TP group) on the directory prefix
        to apply and on the fetches every rank has resolved; decide those (see the
        module docstring)."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.host.publish()  # first: a peer may ask for a block as soon as it hears of it
            self.host.send()
        self.service()
        counts = self.channel.counts()
        states = [j.states() for j in self._jobs]
        flat = np.concatenate(states) if states else np.zeros(0, dtype=np.uint8)
        mine = np.concatenate([counts, (flat != PENDING).astype(np.int64), (flat == LANDED).astype(np.int64)])
        agreed = self.tp.allreduce_min_array(mine, "remote tier (external): step agreement") \
            if self.tp.size > 1 else mine
        n, k = len(counts), len(flat)
        self.directory.apply(self.channel.agreed(agreed[:n]))
        resolved, good = agreed[n:n + k].astype(bool), agreed[n + k:].astype(bool)
        at, left = 0, []
        for job, st in zip(self._jobs, states):
            r, g = resolved[at:at + len(st)], good[at:at + len(st)]
            at += len(st)
            if r.all():
                self._decide(job, g)
            else:
                left.append(job)
        self._jobs = left

    def _decide(self, job: _Job, good: np.ndarray) -> None:
        """The group's verdict on ``job``: its good rows go to the caller (who frees them
        by ``release`` once copied out), the others are freed once nothing writes them."""
        rows = np.concatenate([b.dst for b in job.batches]) if job.batches else np.zeros(0, np.int64)
        blocks = np.concatenate([*job.blocks, job.norow])
        landed = good[:len(rows)]
        failed = tuple(blocks[~good].tolist())
        self._decided.append(Fetched(job.request_id, rows[landed], blocks[good], failed))
        self.counters["blocks_landed"] += int(good.sum())
        self.counters["blocks_failed"] += int((~good).sum())
        at, forget = 0, []
        for b in job.batches:
            b.decided[:] = True
            ok = landed[at:at + len(b)]
            b.released |= ok
            at += len(b)
            if not ok.all():
                forget.append((b.peer, b.peer_slots[~ok]))
        self._forget(forget)
        self._draining.extend(b for b in job.batches if not b.released.all())
        self._drained()

    def _forget(self, entries: list[tuple[int, np.ndarray]]) -> None:
        """Drop the directory's entries of blocks the group just gave up (stale, late or
        failed): the planners stop offering them until the holder lists its slot again.
        Every TP rank drops the same ones at the same boundary (the verdict is agreed),
        so their directories stay equal (R4)."""
        def none(n: int) -> np.ndarray:
            return np.zeros(n, dtype=np.uint64)

        if entries:
            self.directory.apply([(peer, encode(slots, none(len(slots)), none(len(slots)), none(len(slots))))
                                  for peer, slots in entries])

    def _drained(self) -> None:
        """Free the landing rows of given-up blocks that nothing can still write (a
        cancelled copy may be under way: DONE says it is not)."""
        left = []
        for b in self._draining:
            free = ((b.state & DONE) != 0) & ~b.released
            b.released |= free
            self._free.extend(b.dst[free].tolist())
            if not b.released.all():
                left.append(b)
        self._draining = left

    def decided(self) -> list[Fetched]:
        """The fetches decided since the last call; copy each one's rows out, then
        ``release`` them."""
        out, self._decided = self._decided, []
        return out

    def release(self, rows: np.ndarray) -> None:
        """Landing rows copied into the engine's blocks: free again."""
        self._free.extend(np.asarray(rows, dtype=np.int64).tolist())

    # -- observability, teardown --------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.counters, "in_flight": len(self._jobs), "directory_blocks": self.directory.known(),
                "directory_messages_sent": self.channel.messages_sent,
                "directory_messages_received": self.channel.messages_received,
                "landing_rows_free": len(self._free)}

    def check_invariants(self) -> None:
        self.directory.check_invariants()
        held = sum(len(b) for j in self._jobs for b in j.batches) + \
            sum(int((~b.released).sum()) for b in self._draining)
        assert held + len(self._free) <= self.landing.shape[0], "landing rows counted twice"

    def close(self) -> None:
        self.channel.close()
        for f in self._fetchers:
            f.close([b for j in self._jobs for b in j.batches if self.transports[b.peer] is f]
                    + [b for b in self._draining if self.transports[b.peer] is f])
        self.server.close()
        self.transports, self._fetchers, self._jobs, self._draining = {}, [], [], []
        self.stamps.close()
