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
unless a ``prefetch`` already started them. A prefetch leaves alone a prompt whose
remote blocks all come from ``near`` peers (replicas whose every rank shares this
node): add_sequence's own fetch lands those straight in the GPU slots by one DMA from
the peer's mapping, as fast as a host onboard, so nothing is gained by holding the
request back a step for them; ``rules`` (a frozen ``RemoteRules``, read
at construction) can drop R1, R2 or R4 for the tests that show what each one prevents."""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from ..admission_plan import AdmissionPlan
from ..blocks import GPU, HOST
from ..eviction import DEFAULT_PRIORITY
from ..prefix import MASK64
from .directory import Directory
from .directory_channel import DirectoryChannel
from .host_changes import HostChanges, HostSlots
from .message_server import MessageServer
from .remote_rules import RemoteRules
from .stamps import SlotStamps
from .transport import DONE, GOOD, NOTBAD, REASONS, Batch, Fetcher

_PREFETCH_RECORDS = 4096  # prefetches remembered for add_sequence's hit accounting


class LocalSlots(HostSlots, Protocol):
    """What the remote tier needs from this rank's manager (``kvdist.landing.ManagerSlots``)."""

    tokens_per_block: int
    executor: object

    def block_hashes(self, tokens: Iterable[int]) -> list[int]: ...
    def cached_prefix(self, hashes: list[int]) -> list[int]: ...
    def tier_of(self, h: int) -> int | None: ...
    def reserve(self, tier: int, n: int) -> list[int]: ...
    def land(self, slot: int, h: int, priority: int = DEFAULT_PRIORITY) -> bool: ...
    def release(self, slot: int) -> None: ...
    def landing_slots(self) -> np.ndarray: ...
    def pending_events(self, slots) -> list: ...


@dataclass(slots=True)
class RemoteCounters:
    """Per rank. ``landed``/``misses`` are the replica's verdicts (equal on its ranks);
    the reasons are this rank's own view of why it gave blocks up."""

    batches: int = 0
    blocks_requested: int = 0
    landed: int = 0
    landed_duplicate: int = 0  # landed but the block was cached here meanwhile
    misses: int = 0
    reasons: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS[1:]})
    hit_blocks: list[int] = field(default_factory=lambda: [0, 0, 0])  # by the tier they were found in
    prefetches: int = 0
    pull_seconds: float = 0.0  # add_sequence waiting for its own fetches
    agree_seconds: float = 0.0  # the TP group's agreements
    upkeep_seconds: float = 0.0  # directory, stamps, service, polling


def _split(hashes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([h >> 64 for h in hashes], dtype=np.uint64),
            np.array([h & MASK64 for h in hashes], dtype=np.uint64))


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
        # Peers whose blocks add_sequence fetches itself rather than a prefetch (every rank
        # of both replicas on one node, sharing memory): the same set on every TP rank
        # (R1: their prefetches start the same batches). A test may empty it to drive the
        # prefetch's landing in the host tier through the shared transport.
        self.near = near
        self.slots = slots
        self.timeout_s = fetch_timeout_s
        self.replica, self.num_replicas = replica, num_replicas
        self.bpb = bytes_per_block
        self.tpb = slots.tokens_per_block
        # At most half a tier's slots wait for fetches at once (the rest keeps caching).
        self.landing_cap = {t: n // 2 for t, n in capacity.items()}
        self.landing_used = dict.fromkeys(capacity, 0)
        self.rules = rules  # frozen; the transports were given theirs when built
        # Directory messages go out every ``every`` steps (step counts decide it, so the TP
        # ranks of a replica cut the same messages); agreements without blocks in flight
        # happen at the same steps.
        self.every = directory_every
        self.steps = 0  # end_steps so far
        self.host = HostChanges(stamps, slots, channel)  # the holder's side: the manager's HostObserver
        self.inflight: list[Batch] = []  # batches not settled, in start order
        self.landing: dict[int, Batch] = {}  # hash -> batch fetching it (until decided)
        self._prefetch: dict[Hashable, list[Batch]] = {}
        self._deferred: dict[Hashable, list[int]] = {}  # prefetches asked for between steps
        self._prefetched: dict[Hashable, set[int]] = {}  # seq -> hashes landed for it
        self.counters = RemoteCounters()
        self._agreed: np.ndarray | None = None  # directory counts the last end_step agreed on
        # Every fetcher once (one message transport fetches from all peers it reaches).
        self._fetchers = list({id(t): t for t in transports.values()}.values())
        self._progressing = [f for f in self._fetchers if type(f).progress is not Fetcher.progress]
        self.server = server  # the holder's side of the message transport: answers peers
        self.serve = serve  # some peer fetches from this rank by messages (else none asks)
        # Which ranks read the node directory's published epochs for the agreement: with
        # R4 the TP group takes the MIN, so TP rank 0 reads and the others leave it to it.
        self._reads_node = tp.size == 1 or not rules.agree_directory or tp.rank == 0

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
        agree = bool(self.inflight) or self.steps % self.every == 0
        self.service(directory=agree)
        if agree:
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

    # -- agreement and verdicts -----------------------------------------------------------------------
    def _agree(self, counts: np.ndarray | None, batches: list[Batch], what: str,
               extra: list[int] | None = None) -> tuple[np.ndarray | None, np.ndarray, list[int] | None]:
        """(directory counts, outcome bits per block of ``batches``, ``extra``) as the
        replica's ranks agree on them: MIN of the counts and of ``extra`` (a caller's own
        figures riding along), AND of the bits (as MIN of each 0/1 bit)."""
        states = (np.concatenate([b.state for b in batches]) if batches
                  else np.zeros(0, dtype=np.uint8)).astype(np.int64)
        ride = [] if extra is None else list(extra)
        rules = self.rules
        if self.tp.size == 1 or not (rules.agree_outcomes or rules.agree_directory or ride):
            return counts, states.astype(np.uint8), extra
        bits = [(states & bit) != 0 for bit in (GOOD, DONE, NOTBAD)]
        mine = np.concatenate([np.array(ride, dtype=np.int64),
                               counts if counts is not None else np.zeros(0, dtype=np.int64), *bits])
        out = self.tp.allreduce_min_array(mine, what)
        agreed_extra = None if extra is None else out[:len(ride)].tolist()
        out = out[len(ride):]
        n = 0 if counts is None else len(counts)
        agreed_counts = out[:n] if rules.agree_directory else counts
        if rules.agree_outcomes:
            k = len(states)
            g, d, nb = out[n:n + k], out[n + k:n + 2 * k], out[n + 2 * k:n + 3 * k]
            states = g * GOOD + d * DONE + nb * NOTBAD
        return agreed_counts, states.astype(np.uint8), agreed_extra

    def _decide(self, batches: list[Batch], verdicts: np.ndarray) -> set[int]:
        """Act on the replica's verdicts, in batch order: land blocks every rank has
        whole, give up blocks some rank gave up, free their slots once no transfer can
        still write them. Returns the hashes landed."""
        landed: set[int] = set()
        at = 0
        c = self.counters
        for b in batches:
            v = verdicts[at:at + len(b)]
            at += len(b)
            mine: set[int] = set()
            for i in np.flatnonzero(~b.released).tolist():
                h = int(b.hi[i]) << 64 | int(b.lo[i])
                if not b.decided[i]:
                    if v[i] & GOOD:
                        b.decided[i] = b.released[i] = True
                        self._untrack(b, i, h)
                        if self.slots.land(int(b.dst[i]), h):
                            mine.add(h)
                            c.landed += 1
                        else:
                            c.landed_duplicate += 1
                        continue
                    if v[i] & NOTBAD:
                        continue  # pending somewhere: decided at a later boundary
                    b.decided[i] = True
                    self._untrack(b, i, h)
                    c.misses += 1
                    if b.reason[i]:
                        c.reasons[REASONS[b.reason[i]]] += 1
                if v[i] & DONE:
                    b.released[i] = True
                    self.slots.release(int(b.dst[i]))
            if b.seq_id is not None and mine:
                self._prefetched.setdefault(b.seq_id, set()).update(mine)
            landed |= mine
        return landed

    def _untrack(self, b: Batch, i: int, h: int) -> None:
        if self.landing.get(h) is b:
            del self.landing[h]
        self.landing_used[b.tier] -= 1

    # -- fetching ---------------------------------------------------------------------------------------
    def _plan(self, hashes: list[int], seq_id: Hashable | None) -> list[Batch]:
        """Reserve landing slots for the longest run of leading ``hashes`` that peers
        hold (stopping at a block already on its way) and start the batches, one per
        holder and landing tier. ``hashes`` start after the local cached prefix. A
        prefetch (``seq_id``) of blocks all held by ``near`` peers starts nothing."""
        held = self._holders(hashes)
        prefetch = seq_id is not None
        if not held or (prefetch and self._near_only(held)):
            return []
        per_batch: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (peer, tier) -> blocks
        for h, (peer, slot) in zip(hashes, held):
            tier = self.transports[peer].landing_tier(prefetch)
            if prefetch and self.landing_used[tier] >= self.landing_cap[tier]:
                break  # prefetches leave half of a tier to caching
            got = self.slots.reserve(tier, 1)
            if not got:
                break
            self.landing_used[tier] += 1
            per_batch.setdefault((peer, tier), []).append((h, slot, got[0]))
        batches = []
        deadline = time.monotonic() + self.timeout_s
        for (peer, tier), blocks in per_batch.items():
            hs = [h for h, _, _ in blocks]
            hi, lo = _split(hs)
            b = Batch(peer, np.array([s for _, s, _ in blocks], dtype=np.int64), hi, lo,
                      np.array([d for _, _, d in blocks], dtype=np.int64), tier, deadline, seq_id)
            for h in hs:
                self.landing[h] = b
            self.transports[peer].start(b)
            self.counters.batches += 1
            self.counters.blocks_requested += len(b)
            batches.append(b)
        return batches

    def _holders(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(peer, its slot) of the longest run of leading ``hashes`` peers hold, up to the
        first block already on its way here."""
        out = []
        for h, g in zip(hashes, self.directory.match(hashes)):
            if h in self.landing:
                break
            out.append(self.directory.holder(g))
        return out

    def _near_only(self, held: list[tuple[int, int]]) -> bool:
        """Whether every block of ``held`` comes from a ``near`` peer."""
        near = self.near
        return bool(near) and all(peer in near for peer, _ in held)

    def _reusable(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """(hashes of the full blocks, the leading ones add_sequence may reuse)."""
        full = self.slots.block_hashes(tokens)
        return full, full[: max(len(tokens) - 1, 0) // self.tpb]

    def prefetch(self, seq_id: Hashable, tokens: Iterable[int], now: bool) -> int:
        """Start the remote blocks of a prompt (non-blocking); how many are on their way
        (none when every one comes from a ``near`` peer: add_sequence fetches them by
        DMA, as fast as it onboards host hits). Outside a step (``now`` False) they
        start right after the next ``begin_step`` (their landing slots may evict blocks,
        whose copies must follow the last step's kernels, rule S4); the count is then
        the blocks the directory lists."""
        tokens = tokens if isinstance(tokens, list | tuple) else list(tokens)
        _, hashes = self._reusable(tokens)
        if not now:
            n = self._listed(hashes)
            if n:
                self._deferred[seq_id] = hashes
                self._prefetch.setdefault(seq_id, [])
            return n
        return self._start_prefetch(seq_id, hashes)

    def _start_prefetch(self, seq_id: Hashable, hashes: list[int]) -> int:
        batches = self._plan(hashes[len(self.slots.cached_prefix(hashes)):], seq_id)
        if batches:
            self.inflight.extend(batches)
            self._prefetch.setdefault(seq_id, []).extend(batches)
            self.counters.prefetches += 1
        return sum(len(b) for b in batches)

    def start_deferred(self) -> None:
        """Start the prefetches asked for between steps (call after the step began)."""
        deferred, self._deferred = self._deferred, {}
        for seq_id, hashes in deferred.items():
            self._start_prefetch(seq_id, hashes)

    def _listed(self, hashes: list[int]) -> int:
        """Blocks after the local prefix that the directory lists, up to one on its way
        (none when all come from ``near`` peers: add_sequence fetches those)."""
        held = self._holders(hashes[len(self.slots.cached_prefix(hashes)):])
        return 0 if self._near_only(held) else len(held)

    def prefetch_ready(self, seq_id: Hashable) -> bool:
        if seq_id in self._deferred:
            return False
        batches = self._prefetch.get(seq_id)
        if batches is None:
            return True
        if all(b.decided.all() for b in batches):
            del self._prefetch[seq_id]
            return True
        return False

    def pull(self, hashes: list[int]) -> set[int]:
        """add_sequence's own fetch: start the blocks of ``hashes`` (a prompt's after its
        local cached prefix) that peers hold, wait until this rank has each (or gave it
        up: at most ``fetch_timeout_ms``), agree, land. Collective inside the TP group
        when anything was started (the ranks start the same batches: their directories
        and caches are equal)."""
        batches = self._plan(hashes, None)
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
        seq_id = plan.seq_id
        landed = self._prefetched.pop(seq_id, set()) if self._prefetched else set()
        if self._prefetch:
            self._prefetch.pop(seq_id, None)
        if self._deferred:
            self._deferred.pop(seq_id, None)
        if plan.fits:
            landed |= self.pull(plan.remote_hashes)
        if len(self._prefetched) > _PREFETCH_RECORDS:  # prefetched, never admitted
            self._prefetched.pop(next(iter(self._prefetched)))
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
        c = self.counters
        kinds: dict[str, int] = {}
        for t in self.transports.values():
            kinds[t.name] = kinds.get(t.name, 0) + 1
        return {
            "transports": kinds,  # peers reached by each transport
            "batches": c.batches,
            "blocks_requested": c.blocks_requested,
            "blocks_landed": c.landed,
            "blocks_landed_duplicate": c.landed_duplicate,
            "misses": c.misses,
            "given_up_here": dict(c.reasons),
            "in_flight_blocks": sum(int((~b.decided).sum()) for b in self.inflight),
            "prefetches": c.prefetches,
            "directory_blocks": self.directory.known(),
            "directory_bytes": self.directory.nbytes,
            "node_directory_bytes": node.shape.nbytes if (node := self.channel.node) else 0,
            "directory_records_applied": self.directory.records_applied,
            "directory_messages_sent": self.channel.messages_sent,
            "directory_bytes_sent": self.channel.bytes_sent,
            "directory_messages_received": self.channel.messages_received,
            "pull_seconds": c.pull_seconds,
            "agree_seconds": c.agree_seconds,
            "upkeep_seconds": c.upkeep_seconds,
        }

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
        expected = np.sort(np.concatenate([b.dst[~b.released] for b in self.inflight])
                           if self.inflight else np.zeros(0, dtype=np.int64))
        assert np.array_equal(expected, self.slots.landing_slots()), \
            "landing slots differ from the unreleased blocks of in-flight batches"
        undecided = sum(int((~b.decided).sum()) for b in self.inflight)
        assert undecided == len(self.landing), "blocks on their way != in-flight undecided blocks"
        used = dict.fromkeys(self.landing_used, 0)
        for b in self.inflight:
            used[b.tier] += int((~b.decided).sum())
        assert used == self.landing_used, f"landing counts {self.landing_used}, expected {used}"

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


__all__ = ["GPU", "HOST", "LocalSlots", "RemoteTier", "shm_dir"]
