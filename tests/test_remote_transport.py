"""The one-node transport and the directory, in one process: a holder's host tier in a
shared file, mapped a second time as a peer's view; fetches into the GPU tier and into
the host tier through each kind of copy (at once, simulated stream, and the CUDA
executor's — DMA on a stream, memcpy on a worker thread — with CUDA's streams and
events replaced by the stand-ins of ``test_cuda_executor_on_cpu``); stamps that make a
reused slot a miss (R2), checked before and after the copy."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import torch

from kvdist.bench.remote import DetachedSlots
from kvdist.blocks import GPU, HOST
from kvdist.distributed import peer_copy
from kvdist.distributed.directory import Directory, encode
from kvdist.distributed.peer_copy import CudaCopier, ImmediateCopier, SimulatedCopier
from kvdist.distributed.shared_transport import SharedTransport
from kvdist.distributed.stamps import SlotStamps
from kvdist.distributed.transport import DONE, LANDED, PENDING, STALE, Batch
from kvdist.layout import KVLayout
from kvdist.storage import GpuPool, HostPool
from kvdist.transfer import HostCopies, SimExecutor, SyncExecutor
from kvdist.transfer import cuda as cuda_executor

from .test_cuda_executor_on_cpu import fake_cuda  # noqa: F401  (a fixture)

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="uint8", tokens_per_block=4)
N = 32


@pytest.fixture
def holder(tmp_path):
    pool = HostPool(LAYOUT, N, pin=False, shared_path=str(tmp_path / "host"), progress=False)
    stamps = SlotStamps(N, str(tmp_path / "stamps"))
    pool.raw[:] = (torch.arange(N * LAYOUT.bytes_per_block) % 251).to(torch.uint8).view(N, -1)
    slots = np.arange(N)
    stamps.publish(slots, (slots + 1).astype(np.uint64), np.full(N, 7, dtype=np.uint64))
    yield pool, stamps
    stamps.close()
    pool.close()


def _executor(kind: str, gpu: GpuPool, host: HostPool):
    if kind == "cuda":
        return cuda_executor.CudaExecutor(gpu, host, None, torch.device("cpu"))
    copies = HostCopies(gpu, host, None)
    return SimExecutor(copies) if kind == "simulated" else SyncExecutor(copies)


@pytest.mark.parametrize("kind", ["immediate", "simulated", "cuda"])
@pytest.mark.parametrize("tier", [GPU, HOST])
def test_fetch_lands_the_peers_bytes_and_misses_what_it_reused(holder, kind, tier, request, tmp_path):
    if kind == "cuda":
        request.getfixturevalue("fake_cuda")
    pool, stamps = holder
    gpu, host = GpuPool(LAYOUT, N, torch.device("cpu")), HostPool(LAYOUT, N, pin=False)
    peer = HostPool(LAYOUT, N, pin=False, shared_path=pool.shared_path, attach=True)
    peer_stamps = SlotStamps(N, stamps.shared_path, attach=True)
    executor = _executor(kind, gpu, host)
    copier = {"cuda": lambda: CudaCopier(executor, torch.device("cpu")),  # the variant a tier's build picks
              "simulated": lambda: SimulatedCopier(executor),
              "immediate": lambda: ImmediateCopier(executor)}[kind]()
    transport = SharedTransport(peer, peer_stamps, {GPU: gpu.raw, HOST: host.raw}, copier,
                                DetachedSlots(executor))
    try:
        src = np.array([5, 17, 2, 30, 9], dtype=np.int64)
        dst = np.array([0, 11, 3, 7, 20], dtype=np.int64)
        stamps.invalidate_one(9)  # the holder is reusing slot 9: a miss from the start
        b = Batch(0, src, (src + 1).astype(np.uint64), np.full(5, 7, dtype=np.uint64), dst, tier, 1e18)
        transport.start(b)
        while not b.resolved:
            transport.poll(b, 0.0)
        assert b.state.tolist() == [LANDED] * 4 + [DONE] and b.reason[4] == STALE
        raw = (gpu if tier == GPU else host).raw
        assert torch.equal(raw[dst[:4]], pool.raw[src[:4]])
        assert not raw[20].any(), "a stale block was copied"
        # Reused while the copy was queued (simulated stream held): the second reading misses.
        if kind == "simulated":
            executor.hold("remote")
            b = Batch(0, src[:2], (src[:2] + 1).astype(np.uint64), np.full(2, 7, dtype=np.uint64),
                      np.array([1, 2]), tier, 1e18)
            transport.start(b)
            assert not b.resolved
            stamps.invalidate_one(17)
            pool.raw[17].fill_(0)
            stamps.publish([17], np.array([99], dtype=np.uint64), np.array([7], dtype=np.uint64))
            executor.release("remote")
            transport.poll(b, 0.0)
            assert b.state.tolist() == [LANDED, DONE] and b.reason[1] == STALE
    finally:
        transport.close([])
        executor.close()
        gpu.close()
        host.close()


def test_directory_applies_a_steps_records_at_once_and_finds_every_holder():
    d = Directory(4, 0, 64)
    h = [(1 << 64) * (k + 1) + 1000 + k for k in range(10)]
    rec = lambda slots, held, hashes: encode(np.array(slots, dtype=np.int32), np.array(held, dtype=np.int32),  # noqa: E731
                                             np.array([x >> 64 for x in hashes], dtype=np.uint64),
                                             np.array([x & ((1 << 64) - 1) for x in hashes], dtype=np.uint64))
    # Peer 1 holds h0..h3 in slots 10..13; peer 2 holds h2, h3 too; in one message peer 1
    # then drops slot 11 and puts h5 there (the last record of a slot stands).
    d.apply([(1, rec([10, 11, 12, 13], [1, 1, 1, 1], h[:4])), (2, rec([5, 6], [1, 1], h[2:4])),
             (1, rec([11, 11], [0, 1], [0, h[5]]))])
    d.check_invariants()
    assert d.match(h[:4]) == [64 + 10]  # h1 left peer 1 and nobody else holds it
    assert [d.holder(g) for g in d.match(h[2:4])] in ([(1, 12), (1, 13)], [(2, 5), (1, 13)],
                                                      [(1, 12), (2, 6)], [(2, 5), (2, 6)])
    assert d.match([h[5]]) == [64 + 11] and len(d) == 6
    d.apply([(1, rec([12, 13], [0, 0], [0, 0]))])  # peer 1 lets h2, h3 go: peer 2 still has them
    d.check_invariants()
    assert [d.holder(g) for g in d.match(h[2:4])] == [(2, 5), (2, 6)]
    with pytest.raises(AssertionError):
        d.apply([(0, rec([1], [1], h[:1]))])  # its own replica


def test_directory_entries_past_a_full_bucket_spill_and_are_found():
    """200 blocks whose hashes all fall into one bucket of 16: the rest spill; every one
    is found, deletes reach spilled entries too, the table stays consistent."""
    d = Directory(2, 0, 200)
    lo = np.arange(200, dtype=np.uint64) * np.uint64(d.table.mask + 1) + np.uint64(3)  # one bucket
    every = np.arange(200, dtype=np.int32)
    d.apply([(1, encode(every, np.ones(200, dtype=np.int32), np.ones(200, dtype=np.uint64), lo))])
    d.check_invariants()
    assert sum(map(len, d.table.spill.values())) == 200 - 16
    assert [d.table.find(1, int(x)) for x in lo] == every.tolist()  # mirror entries: peer 1 is the first
    assert d.match([(1 << 64) | int(x) for x in lo[:3]]) == (200 + every[:3]).tolist()
    d.apply([(1, encode(every[::2], np.zeros(100, dtype=np.int32), np.zeros(100, dtype=np.uint64),
                        np.zeros(100, dtype=np.uint64)))])  # the even slots let their blocks go
    d.check_invariants()
    assert len(d) == 100
    assert [d.table.find(1, int(x)) for x in lo] == [s if s % 2 else -1 for s in range(200)]


# -- when a fetch's copy begins, and how a host landing is spread -----------------------------------
class _Pending(DetachedSlots):
    """Landing slots whose pending copies are ``events``."""

    def __init__(self, executor, events: list):
        super().__init__(executor)
        self.events = events

    def pending_events(self, slots) -> list:
        return list(self.events)


class _GatedEvent:
    """A CUDA event stand-in that completes once the events its stream waited for before
    it was recorded have, and its own ``done`` (set by the test) is true."""

    def __init__(self, enable_timing: bool = False):
        self.after: list = []
        self.done = True

    def record(self, stream=None) -> None:
        self.after = list(getattr(stream, "waited", []))

    def query(self) -> bool:
        return self.done and all(e.query() for e in self.after)

    def synchronize(self) -> None:
        assert self.query(), "a host wait on an event that never completes"


def _shared(holder, kind: str, rates=None, pending: list = ()):
    """(transport, host pool of 2N blocks, closer) over ``holder``'s shared host tier;
    ``pending``: the landing slots' pending copies."""
    pool, stamps = holder
    gpu, host = GpuPool(LAYOUT, N, torch.device("cpu")), HostPool(LAYOUT, 2 * N, pin=False)
    peer = HostPool(LAYOUT, N, pin=False, shared_path=pool.shared_path, attach=True)
    peer_stamps = SlotStamps(N, stamps.shared_path, attach=True)
    executor = _executor(kind, gpu, host)
    copier = CudaCopier(executor, torch.device("cpu")) if kind == "cuda" else SimulatedCopier(executor, rates)
    transport = SharedTransport(peer, peer_stamps, {GPU: gpu.raw, HOST: host.raw}, copier,
                                _Pending(executor, list(pending)))

    def close():
        transport.close([])
        executor.close()
        gpu.close()
        host.close()
    return transport, host, close


def _batch(src, dst, tier, deadline):
    src = np.asarray(src, dtype=np.int64)
    return Batch(0, src, (src + 1).astype(np.uint64), np.full(len(src), 7, dtype=np.uint64),
                 np.asarray(dst, dtype=np.int64), tier, deadline)


def _settle(transport, batches) -> None:
    while not all(b.resolved for b in batches):
        for b in batches:
            transport.poll(b, time.monotonic())
        time.sleep(0.005)


@pytest.mark.usefixtures("fake_cuda")
def test_a_host_landing_queued_behind_another_is_not_late(holder, monkeypatch):
    """CUDA's host landings, on the worker threads: a first fetch's four parts (one a
    thread) take 0.4 s each (slowed here); a second fetch of one block, with a deadline
    of 0.25 s, waits behind them, then copies at once. Its deadline counts from when its
    copy began: it lands, bytes exact (counted from when it was queued it would have
    timed out)."""
    calls = itertools.count()
    copy_rows = peer_copy._copy_rows

    def rows(dst, src, pairs):
        if next(calls) < peer_copy.HOST_COPY_THREADS:  # the first fetch's parts
            time.sleep(0.4)
        copy_rows(dst, src, pairs)
    monkeypatch.setattr(peer_copy, "_copy_rows", rows)
    transport, host, close = _shared(holder, "cuda")
    try:
        first = _batch(range(N), range(N), HOST, 1e18)
        transport.start(first)
        second = _batch([20], [N + 5], HOST, time.monotonic() + 0.25)
        transport.start(second)
        _settle(transport, [first, second])
        assert first.state.tolist() == [LANDED] * N
        assert second.state.tolist() == [LANDED] and second.reason.tolist() == [0]
        assert torch.equal(host.raw[N + 5], holder[0].raw[20])
    finally:
        close()


@pytest.mark.usefixtures("fake_cuda")
def test_a_dma_waiting_for_the_landing_slots_pending_copies_is_not_late(holder, monkeypatch):
    """CUDA, into the GPU tier (add_sequence's own fetch): the DMA waits on its stream for
    the landing slots' pending copy (S2; the previous step's kernels, S4). Its deadline
    counts from when the stream reached it: 0.3 s past a deadline of 0.1 s it is still
    pending, not given up; once the copy it follows completed, it lands, bytes exact."""
    from .test_cuda_executor_on_cpu import FakeEvent, FakeStream

    gated = type("Gated", (_GatedEvent, FakeEvent), {})  # a FakeEvent to the stand-in streams
    monkeypatch.setattr(torch.cuda, "Event", gated)
    dep = gated()
    dep.done = False
    transport, _, close = _shared(holder, "cuda", pending=[dep])
    try:
        assert isinstance(transport.copier.stream, FakeStream)
        b = _batch([3, 9, 14], [7, 0, 2], GPU, time.monotonic() + 0.1)
        transport.start(b)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            transport.poll(b, time.monotonic())
            time.sleep(0.01)
        assert b.state.tolist() == [PENDING] * 3, "given up while its copy waited its turn"
        dep.done = True
        _settle(transport, [b])
        assert b.state.tolist() == [LANDED] * 3
        got, want = transport.landing[GPU][torch.tensor([7, 0, 2])], holder[0].raw[torch.tensor([3, 9, 14])]
        assert torch.equal(got, want)
    finally:
        close()


@pytest.mark.usefixtures("fake_cuda")
def test_a_host_landing_is_split_over_the_worker_threads(holder, monkeypatch):
    """32 blocks into the host tier: four parts of eight, each on its own worker thread
    (numpy's row copies release the GIL), every block's bytes exact."""
    seen: list[tuple[str, int]] = []
    copy_rows = peer_copy._copy_rows
    gate = threading.Barrier(peer_copy.HOST_COPY_THREADS, timeout=10)

    def rows(dst, src, pairs):
        seen.append((threading.current_thread().name, len(pairs)))
        gate.wait()  # every part runs at once, or this times out
        copy_rows(dst, src, pairs)
    monkeypatch.setattr(peer_copy, "_copy_rows", rows)
    transport, host, close = _shared(holder, "cuda")
    try:
        b = _batch(range(N), list(range(N))[::-1], HOST, 1e18)
        transport.start(b)
        _settle(transport, [b])
        assert b.state.tolist() == [LANDED] * N
        assert len({name for name, _ in seen}) == 4 and sorted(n for _, n in seen) == [8, 8, 8, 8]
        assert torch.equal(host.raw[torch.arange(N - 1, -1, -1)], holder[0].raw)
    finally:
        close()


@pytest.mark.parametrize("tier", [GPU, HOST])
def test_the_simulated_remote_stream_at_a_modelled_bandwidth(holder, tier):
    """``KVDIST_SIM_REMOTE_GBPS``'s model: each destination a FIFO channel at its rate.
    Four 128-byte blocks at 2,560 B/s take 0.2 s; a second fetch into the same tier
    begins exactly when the first is done, one into the other tier is done at once;
    the bytes are the holder's."""
    rates = {tier == GPU: 2560.0, tier != GPU: 1e12}
    transport, host, close = _shared(holder, "simulated", rates)
    try:
        a = _batch([1, 2, 3, 4], [1, 2, 3, 4], tier, 1e18)
        b = _batch([5], [5], tier, 1e18)
        other = _batch([6], [6], HOST if tier == GPU else GPU, 1e18)
        ops = []
        for x in (a, b, other):
            transport.start(x)
            ops.append(x.transfer.op if x.transfer is not None else None)
        assert other.resolved and not a.resolved and not b.resolved
        assert LAYOUT.bytes_per_block == 128
        assert ops[1].began() == pytest.approx(ops[0].began() + 0.2, abs=1e-9)
        _settle(transport, [a, b])
        assert (a.state == LANDED).all() and (b.state == LANDED).all()
        raw = transport.landing[tier]
        assert torch.equal(raw[torch.tensor([1, 2, 3, 4, 5])], holder[0].raw[torch.tensor([1, 2, 3, 4, 5])])
    finally:
        close()
