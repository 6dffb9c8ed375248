"""The one-node transport and the directory, in one process: a holder's host tier in a
shared file, mapped a second time as a peer's view; fetches into the GPU tier and into
the host tier through each kind of copy (at once, simulated stream, and the CUDA
executor's — DMA on a stream, memcpy on a worker thread — with CUDA's streams and
events replaced by the stand-ins of ``test_cuda_executor_on_cpu``); stamps that make a
reused slot a miss (R2), checked before and after the copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdist.bench.remote import DetachedSlots
from kvdist.blocks import GPU, HOST
from kvdist.distributed.directory import Directory, encode
from kvdist.distributed.peer_copy import CudaCopier, ImmediateCopier, SimulatedCopier
from kvdist.distributed.shared_transport import SharedTransport
from kvdist.distributed.stamps import SlotStamps
from kvdist.distributed.transport import DONE, LANDED, STALE, Batch
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
