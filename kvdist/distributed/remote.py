"""The remote tier: one rank's part of sharing host tiers between replicas (docs/design.md,
"Remote tier"; rules R1–R4).

As a *holder* (``host_changes.HostChanges``) it stamps its host slots as the manager
fills and empties them, and every few steps, at ``end_step``, sends the host-tier
changes to the same TP rank of every other replica (``DirectoryChannel``). As a
*fetcher* it looks a prompt's blocks that no local tier holds up in the directory,
reserves landing slots, and has a transport copy each block from the holder's slot —
its own shard, from the holder's rank with the same TP index. A block lands (becomes
an ordinary cached block) only when every TP rank of the replica has it whole (R1);
stale and late blocks are misses.

Step boundaries are where the replica's ranks agree: one MIN-reduce inside the TP
group (at ``begin_step``, or at ``end_step`` riding on the recompute policy's) carries the
directory message counts (R4: all apply the same prefix) and every in-flight block's
outcome bits (R1). Nothing after start-up is
collective across replicas (R3); a fetch waits at most ``fetch_timeout_ms``.

``add_sequence`` pulls a prompt's remote blocks itself (waiting up to the timeout)
unless a ``prefetch`` already started them. A prefetch leaves alone a prompt's blocks
that ``near`` peers hold (replicas whose every rank shares this node) and starts only
the other peers' (a request may have both): add_sequence's own fetch lands the near
ones straight in the GPU slots by one DMA from the peer's mapping, as fast as a host
onboard, so nothing is gained by holding the request back a step for them. ``rules``
(a frozen ``RemoteRules``, read at construction) can drop R1, R2 or R4 for the tests
that show what each one prevents.

This module drives the step boundaries and the calls of ``KVCache``; each concept is a
module of its own below it: fetch planning and the blocks on their way
(``remote_plan``), the replica's verdicts (``remote_verdicts``), prefetches
(``remote_prefetch``), figures (``remote_figures``)."""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Iterable

import numpy as np
import xxhash

from ..admission_plan import AdmissionPlan
from ..blocks import GPU, HOST
from .directory import Directory
from .directory_channel import DirectoryChannel
from .host_changes import HostChanges
from .message_server import MessageServer
from .remote_figures import RemoteCounters, remote_figures
from .remote_plan import Landings, LocalSlots
from .remote_prefetch import Prefetches
from .remote_rules import RemoteRules
from .remote_verdicts import agree, decide
from .stamps import SlotStamps
from .transport import Batch, Fetcher

__all__ = ["GPU", "HOST", "LocalSlots", "RemoteCounters", "RemoteTier", "shm_dir"]


class RemoteTier:
    """One rank's remote tier (see the module docstring). Built by
    ``kvdist.distributed.remote_setup``; driven by ``KVCache``."""

    def __init__(self, *, tp, channel: DirectoryChannel, directory: Directory, stamps: SlotStamps,
                 transports: dict[int, Fetcher], server: MessageServer, rules: RemoteRules,
                 slots: LocalSlots, fetch_timeout_s: float, replica: int, num_replicas: int,
                 bytes_per_block: int, capacity: dict[int, int], directory_every: int = 1,
                 serve: bool = True, near: frozenset[int] = frozenset()):
        self.tp = tp  # the TP group's communicator (MpiComm, or SingleComm for TP 1)
        self.channel, self.directory, self.stamps = channel, directory, stamps
        self.transports = transports  # peer replica -> transport
        self.slots = slots
        self.timeout_s = fetch_timeout_s
        self.replica, self.num_replicas = replica, num_replicas
        self.bpb = bytes_per_block
        self.tpb = slots.tokens_per_block
        self.rules = rules  # frozen; the transports were given theirs when built
        # Directory messages go out every ``every`` steps (step counts decide it, so the TP
        # ranks of a replica cut the same messages); agreements without blocks in flight
        # happen at the same steps.
        self.every = directory_every
        self.steps = 0  # end_steps so far
        self.host = HostChanges(stamps, slots, channel)  # the holder's side: the manager's HostObserver
        self.counters = RemoteCounters()
        # Peers whose blocks add_sequence fetches itself rather than a prefetch (every rank
        # of both replicas on one node, sharing memory): the same set on every TP rank
        # (R1: their prefetches start the same batches). A test may empty it (``near``) to
        # drive the prefetch's landing in the host tier through the shared transport.
        self.landings = Landings(directory, transports, slots, capacity, fetch_timeout_s, self.counters,
                                 near)
        self.prefetches = Prefetches(self.landings, slots, self.counters)
        self.inflight: list[Batch] = []  # batches not settled, in start order
        self._agreed: np.ndarray | None = None  # directory counts the last end_step agreed on
        # Every fetcher once (one message transport fetches from all peers it reaches).
        self._fetchers = list({id(t): t for t in transports.values()}.values())
        self._progressing = [f for f in self._fetchers if type(f).progress is not Fetcher.progress]
        self.server = server  # the holder's side of the message transport: answers peers
        self.serve = serve  # some peer fetches from this rank by messages (else none asks)
        # Which ranks read the node directory's published epochs for the agreement: with
        # R4 the TP group takes the MIN, so TP rank 0 reads and the others leave it to it.
        self._reads_node = tp.size == 1 or not rules.agree_directory or tp.rank == 0

    @property
    def near(self) -> frozenset[int]:
        """The peers whose blocks a prefetch leaves to add_sequence's own fetch."""
        return self.landings.near

    @near.setter
    def near(self, peers: frozenset[int]) -> None:
        self.landings.near = peers

    # -- step boundaries ----------------------------------------------------------------------------
    def service(self, also: list[Batch] = (), directory: bool = True) -> None:
        """Answer peers, match arrived directory messages (if ``directory``), poll the
        fetches in flight and ``also`` (never blocks). Nothing at all when no peer can
        ask, nothing is in flight and no message can come."""
        if not (self.serve or self._progressing or self.inflight or also
                or (directory and self.channel.peers)):
            return
        t0 = time.perf_counter()
        if self.serve:
            self.server.service()
        for f in self._progressing:  # the transports with work between polls
            f.progress()
        if directory:
            self.channel.poll()
        if self.inflight or also:
            now = time.monotonic()
            for b in (*self.inflight, *also):
                self.transports[b.peer].poll(b, now)
        self.counters.upkeep_seconds += time.perf_counter() - t0

    def begin_step(self) -> None:
        """The replica agrees on the directory prefix to apply and on every in-flight
        block's verdict, and acts on both (one MIN-reduce inside the TP group), at
        boundaries with blocks in flight and every ``every`` steps (the same boundaries
        on every TP rank: they have the same blocks in flight and step counts). When
        the last ``end_step`` agreed already (riding on the step's own MIN-reduce), it
        applies that agreed prefix and agrees nothing here."""
        if self._agreed is not None:
            self.service(directory=False)
            t0 = time.perf_counter()
            self._apply(self._agreed)
            self._agreed = None
            self.counters.upkeep_seconds += time.perf_counter() - t0
            return
        due = bool(self.inflight) or self.steps % self.every == 0
        self.service(directory=due)
        if due:
            self._agree_and_act()

    def end_step(self, extra: list[int] | None = None) -> list[int] | None:
        """Every ``every`` steps: stamp valid what landed in the host tier and tell the
        peers what changed in it (they cannot ask for a block before they hear of it).
        ``extra``: figures the caller MIN-reduces over the TP group at every step (the
        recompute policy's). When the next ``begin_step`` would agree (blocks in flight, or a
        directory boundary), the agreement rides on that MIN-reduce now and the agreed
        ``extra`` is returned; otherwise None (the caller reduces its figures itself)."""
        t0 = time.perf_counter()
        self.steps += 1
        if self.steps % self.every == 0:
            self.host.publish()  # first: a peer may ask for a block as soon as it hears of it
            self.host.send()
        self.counters.upkeep_seconds += time.perf_counter() - t0
        due = bool(self.inflight) or self.steps % self.every == 0  # the same on every TP rank
        self._agreed = None
        if extra is None or not due:
            self.service(directory=False)
            return None
        self.service()
        return self._agree_and_act(extra, apply=False)

    def _agree_and_act(self, extra: list[int] | None = None, apply: bool = True) -> list[int] | None:
        """One MIN-reduce of the directory counts, the in-flight blocks' bits (and
        ``extra``); decide those blocks; apply the agreed prefix now (``apply``) or keep
        it for the next begin_step."""
        t0 = time.perf_counter()
        counts = self.channel.counts(read_node=self._reads_node)
        agreed_counts, verdicts, agreed_extra = self._agree(counts, self.inflight,
                                                            "remote tier: step agreement", extra)
        t1 = time.perf_counter()
        if apply:
            self._apply(agreed_counts)
            self._agreed = None
        else:
            self._agreed = agreed_counts
        self._decide(self.inflight, verdicts)
        self.inflight = [b for b in self.inflight if not b.settled]
        self.counters.agree_seconds += t1 - t0
        self.counters.upkeep_seconds += time.perf_counter() - t1
        return agreed_extra

    def _apply(self, agreed_counts: np.ndarray) -> None:
        """The directory messages up to the agreed count of each message peer; the
        node peers' agreed epochs."""
        self.directory.apply(self.channel.agreed(agreed_counts))

    def _agree(self, counts: np.ndarray | None, batches: list[Batch], what: str,
               extra: list[int] | None = None) -> tuple[np.ndarray | None, np.ndarray, list[int] | None]:
        """The replica's agreement (``remote_verdicts.agree``) over this rank's TP group."""
        return agree(self.tp, self.rules, counts, batches, what, extra)

    def _decide(self, batches: list[Batch], verdicts: np.ndarray) -> set[int]:
        """Act on the replica's verdicts (``remote_verdicts.decide``); the hashes landed."""
        return decide(batches, verdicts, self.slots, self.landings, self.counters,
                      self.prefetches.landed_for)

    # -- fetching ---------------------------------------------------------------------------------------
    def prefetch(self, seq_id: Hashable, tokens: Iterable[int], now: bool) -> int:
        """Start the remote blocks of a prompt (non-blocking); how many are on their way
        (none of those a ``near`` peer holds: add_sequence fetches them by DMA, as fast
        as it onboards host hits). Outside a step (``now`` False) they
        start right after the next ``begin_step`` (their landing slots may evict blocks,
        whose copies must follow the last step's kernels, rule S4); the count is then
        the blocks the directory lists."""
        n, batches = self.prefetches.ask(seq_id, tokens, now)
        self.inflight.extend(batches)
        return n

    def start_deferred(self) -> None:
        """Start the prefetches asked for between steps (call after the step began)."""
        self.inflight.extend(self.prefetches.start_deferred())

    def prefetch_ready(self, seq_id: Hashable) -> bool:
        return self.prefetches.ready(seq_id)

    def pull(self, hashes: list[int]) -> set[int]:
        """add_sequence's own fetch: start the blocks of ``hashes`` (a prompt's after its
        local cached prefix) that peers hold, wait until this rank has each (or gave it
        up: at most ``fetch_timeout_ms``), agree, land. Collective inside the TP group
        when anything was started (the ranks start the same batches: their directories
        and caches are equal)."""
        batches = self.landings.plan(hashes, None)
        if not batches:
            return set()
        t0 = time.perf_counter()
        pause = 2e-5
        while True:
            self.service(batches)
            if all(b.resolved for b in batches):
                break
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        t1 = time.perf_counter()
        _, verdicts, _ = self._agree(None, batches, "remote tier: fetched blocks")
        landed = self._decide(batches, verdicts)
        self.inflight.extend(b for b in batches if not b.settled)
        self.counters.pull_seconds += t1 - t0
        self.counters.agree_seconds += time.perf_counter() - t1
        return landed

    # -- add_sequence ----------------------------------------------------------------------------------
    def before_add(self, plan: AdmissionPlan) -> dict[int, int]:
        """Fetch the plan's remote part from peers, when it fits (else nothing changes
        and commit raises). Returns the tier each block fetched for the prompt (by its
        prefetch or now) is in, for ``after_add``, which counts the remote hits."""
        landed = self.prefetches.admitted(plan.seq_id)
        if plan.fits:
            landed |= self.pull(plan.remote_hashes)
        self.prefetches.trim()  # prefetched, never admitted
        return {h: t for h in landed if (t := self.slots.tier_of(h)) is not None} if landed else {}

    def after_add(self, hashes: list[int], tier_of: dict[int, int], reused_tokens: int) -> None:
        """Count the prompt's reused blocks (``hashes[:reused_tokens // tokens per
        block]``) that were fetched for it, by the tier they landed in."""
        if not tier_of:
            return
        for h in hashes[: reused_tokens // self.tpb]:
            t = tier_of.get(h)
            if t is not None:
                self.counters.hit_blocks[t] += 1

    # -- observability -------------------------------------------------------------------------------
    def stats(self) -> dict:
        return remote_figures(self.counters, self.transports.values(), self.inflight, self.directory,
                              self.channel)

    def digest(self) -> bytes:
        """What decides this rank's future remote behaviour (equal on a replica's ranks)."""
        h = xxhash.xxh3_128(self.directory.digest())
        for b in self.inflight:
            h.update(b.dst)
            h.update(b.decided.view(np.uint8))
            h.update(b.released.view(np.uint8))
        return h.digest()

    def check_invariants(self) -> None:
        self.directory.check_invariants()
        if self.channel.node is not None:
            self.channel.node.check_invariants()
        self.landings.check_invariants(self.inflight)

    def close(self) -> None:
        self.channel.close()
        for f in self._fetchers:
            f.close([b for b in self.inflight if self.transports[b.peer] is f])
        self.server.close()
        self.transports, self._fetchers, self.inflight = {}, [], []
        self.stamps.close()


def shm_dir() -> str:
    """Where shared host tiers live: ``KVDIST_SHM_DIR`` or /dev/shm."""
    return os.environ.get("KVDIST_SHM_DIR", "/dev/shm")
