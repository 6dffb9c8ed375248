"""The guards of the remote tier's landing path that one process can show (the ones
that need MPI are in ``tests/mpi/test_landing_guards.py``). Each test was written
against a one-line bug that every other test let through:

* the shared-memory peer copy on simulated streams must follow the landing slots'
  pending copies (S2);
* the holder's stamps (R2, writer side): a host slot's stamp is odd before the pool
  hands a copy into it to the engine, and once it is reserved for a landing;
  ``publish`` leaves it odd while the copy into the slot is pending; a block landed in
  the host tier is stamped and announced like any other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvdist.testing
from kvdist.blocks import GPU, HOST
from kvdist.distributed.host_changes import HostChanges
from kvdist.distributed.peer_copy import SimulatedCopier
from kvdist.distributed.shared_transport import SharedTransport
from kvdist.distributed.stamps import GEN, HI, LO, SlotStamps
from kvdist.distributed.transport import LANDED, Batch
from kvdist.landing import ManagerSlots
from kvdist.layout import KVLayout
from kvdist.storage import GpuPool, HostPool
from kvdist.testing import Seams
from kvdist.transfer import HostCopies, SimExecutor

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="uint8", tokens_per_block=4)
N = 16


class _Pending:
    """Landing slots (tier-local ids) with the engine's copies still pending on some."""

    def __init__(self, events: dict[int, list]):
        self.events = events

    def tier_base(self, tier: int) -> int:
        return 0

    def pending_events(self, slots) -> list:
        return [ev for s in np.asarray(slots).tolist() for ev in self.events.get(s, [])]


def test_shared_copy_on_simulated_streams_follows_the_landing_slots_pending_copies(tmp_path):
    """Landing slot 4 still has a queued copy reading its old block (an eviction's): the
    peer's block may be copied in only after it (S2), however late that copy runs."""
    peer = HostPool(LAYOUT, N, pin=False, shared_path=str(tmp_path / "host"), progress=False)
    stamps = SlotStamps(N, str(tmp_path / "stamps"))
    gpu, host = GpuPool(LAYOUT, N, torch.device("cpu")), HostPool(LAYOUT, N, pin=False)
    executor = SimExecutor(HostCopies(gpu, host, None))
    try:
        peer.raw[9].fill_(99)
        stamps.publish([9], np.array([10], dtype=np.uint64), np.array([7], dtype=np.uint64))
        host.raw[4].fill_(33)  # the old block of the landing slot
        saved = torch.zeros_like(host.raw[4])
        reading = executor.enqueue("offload", lambda: saved.copy_(host.raw[4]))
        transport = SharedTransport(peer, stamps, {GPU: gpu.raw, HOST: host.raw}, SimulatedCopier(executor),
                                    _Pending({4: [reading]}))
        b = Batch(0, np.array([9]), np.array([10], dtype=np.uint64), np.array([7], dtype=np.uint64),
                  np.array([4]), HOST, 1e18)
        transport.start(b)
        while not b.resolved:
            transport.poll(b, 0.0)
        executor.synchronize()
        assert b.state.tolist() == [LANDED]
        assert saved.tolist() == [33] * LAYOUT.bytes_per_block, "the peer's copy overtook a read of the slot"
        assert host.raw[4].tolist() == [99] * LAYOUT.bytes_per_block
        transport.close([])
    finally:
        executor.close()
        gpu.close()
        host.close()


class _Sent:
    """The directory channel's place: the records each message would carry."""

    def __init__(self):
        self.messages: list[np.ndarray] = []

    def send(self, records: np.ndarray) -> None:
        self.messages.append(records)


@pytest.fixture
def holder(cfg_factory):
    """A CPU cache on simulated streams (4 GPU and 8 host blocks) whose host tier is
    watched by a HostChanges, as a remote tier's holder side does."""
    seams = Seams()
    cache = kvdist.testing.create(cfg_factory(gpu=4, host=8, simulate_async=True), seams)
    stamps = SlotStamps(8)
    sent = _Sent()
    changes = HostChanges(stamps, ManagerSlots(seams.manager), sent)
    seams.manager.host_observer = changes
    yield cache, seams, changes, stamps, sent
    seams.manager.host_observer = None
    seams.executor.release("offload")  # a test that failed while holding it
    cache.close()


def _valid(stamps: SlotStamps) -> list[int]:
    return np.flatnonzero((stamps.arr[:, GEN] & np.uint64(1)) == 0).tolist()


def test_publish_leaves_a_host_slot_invalid_while_the_copy_into_it_is_pending(holder):
    cache, seams, changes, stamps, _ = holder
    cache.begin_step()
    cache.add_sequence("a", list(range(9)))  # two full blocks
    cache.block_table(["a"])
    cache.end_step()
    cache.release("a")
    seams.executor.hold("offload")
    cache.begin_step()
    cache.add_sequence("b", list(range(100, 116)))  # four blocks: a's two are offloaded
    changes.publish()
    assert _valid(stamps) == [], "a host slot stamped valid while its offload is still queued"
    seams.executor.release("offload")
    cache.block_table(["b"])
    cache.end_step()
    cache.synchronize()
    changes.publish()
    m = seams.manager
    base = m.space.base[HOST]
    valid = _valid(stamps)
    assert len(valid) == 2
    hi, lo = m.meta.hash_hi[np.array(valid) + base], m.meta.hash_lo[np.array(valid) + base]
    assert stamps.arr[valid, HI].tolist() == hi.tolist() and stamps.arr[valid, LO].tolist() == lo.tolist()


def _spy_copies(monkeypatch, manager, stamps: SlotStamps) -> list[tuple[int, bool]]:
    """(local host slot, its stamp odd) of every copy into the host tier, as the pool
    hands it to the transfer engine."""
    engine, base, seen = manager.engine, manager.space.base[HOST], []
    real_copy, real_copy_many = engine.copy, engine.copy_many

    def note(route, dsts) -> None:
        if route.dst == HOST:
            local = np.asarray(dsts, dtype=np.int64).reshape(-1) - base
            seen.extend(zip(local.tolist(), ((stamps.arr[local, GEN] & np.uint64(1)) == 1).tolist()))

    def copy(route, src, dst):
        note(route, [dst])
        real_copy(route, src, dst)

    def copy_many(route, src, dst):
        note(route, dst)
        real_copy_many(route, src, dst)

    monkeypatch.setattr(engine, "copy", copy)
    monkeypatch.setattr(engine, "copy_many", copy_many)
    return seen


def test_a_host_slot_stamp_is_odd_before_the_copy_into_it_reaches_the_engine(holder, monkeypatch):
    """Prompts of four blocks, one a step, each released: the GPU's blocks go to the
    host tier, and once it is full (no disk) each offload drops a host block and reuses
    its slot, stamped valid meanwhile. Every copy into a host slot finds the slot's
    stamp odd when the pool hands it to the engine (R2's writer side)."""
    cache, seams, changes, stamps, _ = holder
    seen = _spy_copies(monkeypatch, seams.manager, stamps)
    reused = 0  # copies into a slot stamped valid when the step began
    for i in range(6):
        valid, first = set(_valid(stamps)), len(seen)
        cache.begin_step()
        cache.add_sequence(i, list(range(100 * i, 100 * i + 16)))  # four blocks, the GPU's all
        cache.block_table([i])
        cache.end_step()
        cache.release(i)
        cache.synchronize()
        changes.publish()
        reused += sum(s in valid for s, _ in seen[first:])
    assert len(seen) == 20 and reused == 12  # 5 offloads of 4 blocks; the last 3 into published slots
    assert [s for s, odd in seen if not odd] == [], "a copy into a host slot stamped valid"


def test_a_host_slot_reserved_for_a_landing_is_odd_once_reserved(holder):
    """The host tier full (no disk), every slot stamped valid: reserving a landing
    slot drops the host tier's coldest block, with no move; the slot's stamp is odd
    when reserve returns, before the fetched block is copied into it."""
    cache, seams, changes, stamps, _ = holder
    for i in range(3):
        cache.begin_step()
        cache.add_sequence(i, list(range(100 * i, 100 * i + 16)))
        cache.block_table([i])
        cache.end_step()
        cache.release(i)
        cache.synchronize()
    changes.publish()
    assert _valid(stamps) == list(range(8))
    slots = ManagerSlots(seams.manager)
    cache.begin_step()
    (slot,) = slots.reserve(HOST, 1)
    local = slot - seams.manager.space.base[HOST]
    assert seams.manager.counters.dropped == 1
    assert _valid(stamps) == [s for s in range(8) if s != local], "a reserved slot reads as its old block"
    slots.release(slot)
    cache.end_step()


def test_a_block_landed_in_the_host_tier_is_stamped_and_announced(holder):
    _, seams, changes, stamps, sent = holder
    slots = ManagerSlots(seams.manager)
    cache_base = slots.tier_base(HOST)
    (slot,) = slots.reserve(HOST, 1)
    h = (11 << 64) | 12
    assert slots.land(slot, h)
    changes.publish()
    changes.send()
    local = slot - cache_base
    assert _valid(stamps) == [local]
    assert stamps.arr[local, HI] == 11 and stamps.arr[local, LO] == 12
    assert [m.tolist() for m in sent.messages] == [[[local * 2 + 1, 11, 12]]]  # (slot, held), hash
