"""The guards of the remote tier's landing path that need MPI (the others are in
``tests/test_landing_guards.py``). Each test was written against a one-line bug that
every other test let through: the holder must read its stamps again once a block's
send completed (R2); the fetcher must take a trailer only from its own request; the
fetcher's receives into landing slots must follow those slots' pending copies (S2);
a directory message must never block its sender on a peer that does not receive.

The transport tests run on every rank alone (``COMM_SELF``: a rank fetches from
itself), so they hold at any world size."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvdist.blocks import HOST
from kvdist.distributed.directory import encode
from kvdist.distributed.directory_channel import DirectoryChannel
from kvdist.distributed.message_server import MessageServer
from kvdist.distributed.message_transport import MessageTransport
from kvdist.distributed.message_wire import (
    REQUEST_TAG,
    decode_request,
    encode_request,
    encode_trailer,
    tags,
    trailer_size,
    trailer_verdict,
)
from kvdist.distributed.stamps import SlotStamps
from kvdist.distributed.transport import LANDED, STALE, Batch
from kvdist.layout import KVLayout
from kvdist.storage import GpuPool, HostPool
from kvdist.transfer import HostCopies, SimExecutor

pytestmark = pytest.mark.mpi

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="uint8", tokens_per_block=4)
N = 16
BPB = LAYOUT.bytes_per_block


def _hashes(slots) -> tuple[np.ndarray, np.ndarray]:
    slots = np.asarray(slots)
    return (slots + 1).astype(np.uint64), np.full(len(slots), 7, dtype=np.uint64)


@pytest.fixture
def self_comm():
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    yield comm
    comm.Free()


@pytest.fixture
def holder():
    """A host tier whose slot s holds bytes s, stamped valid with hash (s + 1, 7)."""
    host = torch.arange(N, dtype=torch.uint8).repeat_interleave(BPB).view(N, BPB).clone()
    stamps = SlotStamps(N)
    stamps.publish(np.arange(N), *_hashes(np.arange(N)))
    yield host, stamps
    stamps.close()


class _Pending:
    """Landing slots (tier-local ids) with the engine's copies still pending on some."""

    def __init__(self, events: dict[int, list]):
        self.events = events

    def tier_base(self, tier: int) -> int:
        return 0

    def pending_events(self, slots) -> list:
        return [ev for s in np.asarray(slots).tolist() for ev in self.events.get(s, [])]


@pytest.fixture
def landing():
    """This rank's landing host tier (zeros) and a simulated-stream executor over it."""
    gpu, host = GpuPool(LAYOUT, N, torch.device("cpu")), HostPool(LAYOUT, N, pin=False)
    host.raw.zero_()
    executor = SimExecutor(HostCopies(gpu, host, None))
    yield host, executor
    executor.close()
    gpu.close()
    host.close()


def _until(done, what: str, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < end, f"{what}: not within {seconds} s"
        time.sleep(0.0005)


def test_holder_reports_a_slot_reused_while_its_block_was_sent(self_comm, holder):
    """The holder starts sending slots 2, 6, 9; before the sends complete it reuses
    slot 6 for another block. The trailer must call 6 stale: the stamps are read again
    after the sends, not only before them."""
    from mpi4py import MPI

    host, stamps = holder
    server = MessageServer(self_comm, host, stamps)
    slots = np.array([2, 6, 9])
    rid = 41
    request = encode_request(rid, slots, *_hashes(slots))
    asked = self_comm.Isend([request, MPI.INT64_T], dest=0, tag=REQUEST_TAG)
    _until(lambda: (server.service(), server.requests_served)[1] == 1, "the request was never answered")
    # Sends started (no receive posted yet: they cannot complete). The holder reuses slot 6.
    stamps.invalidate_one(6)
    host[6].fill_(200)
    stamps.publish([6], np.array([77], dtype=np.uint64), np.array([7], dtype=np.uint64))
    data_tag, trailer_tag = tags(rid)
    got = np.zeros((3, BPB), dtype=np.uint8)
    trailer = np.zeros(trailer_size(3), dtype=np.uint8)
    reqs = [self_comm.Irecv([got[i], MPI.BYTE], source=0, tag=data_tag) for i in range(3)]
    reqs.append(self_comm.Irecv([trailer, MPI.BYTE], source=0, tag=trailer_tag))
    _until(lambda: (server.service(), MPI.Request.Testall(reqs))[1], "the answer never came")
    asked.Wait()
    assert trailer_verdict(trailer, rid).tolist() == [True, False, True]
    assert got[0].tolist() == [2] * BPB and got[2].tolist() == [9] * BPB
    assert server.stale_served == 1
    server.close()


def test_a_trailer_of_another_request_vouches_for_nothing(self_comm, landing):
    """The fetcher's answer arrives whole, but its trailer carries another request's id
    (an earlier cache's answer on a reused context): no block lands."""
    from mpi4py import MPI

    host, executor = landing
    fetcher = MessageTransport(self_comm, host.raw, _Pending({}), executor, first_id=500)
    b = Batch(0, np.array([3, 4]), *_hashes([3, 4]), np.array([1, 2]), HOST, time.monotonic() + 60)
    fetcher.start(b)
    request = np.empty(2 + 3 * 2, dtype=np.int64)
    self_comm.Recv([request, MPI.INT64_T], source=0, tag=REQUEST_TAG)  # the test is the holder
    rid, slots, _, _ = decode_request(request)
    assert rid == 500 and slots.tolist() == [3, 4]
    data_tag, trailer_tag = tags(rid)
    blocks = np.full((2, BPB), 9, dtype=np.uint8)
    for row in blocks:
        self_comm.Send([row, MPI.BYTE], dest=0, tag=data_tag)
    self_comm.Send([encode_trailer(rid + 1, np.ones(2, dtype=bool)), MPI.BYTE], dest=0, tag=trailer_tag)
    _until(lambda: (fetcher.poll(b, time.monotonic()), b.resolved)[1], "the fetch never resolved")
    assert (b.state != LANDED).all() and b.reason.tolist() == [STALE, STALE]
    fetcher.close([])


def test_message_fetch_waits_for_the_landing_slots_pending_copies(self_comm, holder, landing):
    """Landing slot 4 still has a queued copy reading its old block (an eviction's):
    MPI may write the slot only after it (S2), so the host waits for it before posting
    the receive."""
    host, stamps = holder
    landing_host, executor = landing
    landing_host.raw[4].fill_(33)  # the old block of the landing slot
    saved = torch.zeros(BPB, dtype=torch.uint8)
    reading = executor.enqueue("offload", lambda: saved.copy_(landing_host.raw[4]))
    server = MessageServer(self_comm, host, stamps)
    fetcher = MessageTransport(self_comm, landing_host.raw, _Pending({4: [reading]}), executor)
    b = Batch(0, np.array([11]), *_hashes([11]), np.array([4]), HOST, time.monotonic() + 60)
    fetcher.start(b)
    _until(lambda: (server.service(), fetcher.poll(b, time.monotonic()), b.resolved)[2],
           "the fetch never resolved")
    executor.synchronize()
    assert b.state.tolist() == [LANDED]
    assert saved.tolist() == [33] * BPB, "MPI wrote the slot before a queued copy read it"
    assert landing_host.raw[4].tolist() == [11] * BPB
    fetcher.close([])
    server.close()


def test_directory_send_returns_while_the_peer_does_not_receive():
    """Rank 0 sends a large directory message (past MPI's eager limit) to rank 1, which
    does not receive until told: the send returns at once (a blocking send would stall
    the holder's step on a slow or stopped peer); rank 1 gets the message later."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size < 2:
        pytest.skip("needs two ranks")
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    if pair == MPI.COMM_NULL:
        return
    me = pair.rank
    channel = DirectoryChannel(pair, me, 2, token=5)
    n = 100_000  # 2.4 MB of records
    records = encode(np.arange(n), np.ones(n), np.arange(n, dtype=np.uint64), np.ones(n, dtype=np.uint64))
    try:
        if me == 0:
            sender = threading.Thread(target=channel.send, args=(records,), daemon=True)
            sender.start()
            sender.join(10.0)
            assert not sender.is_alive(), "DirectoryChannel.send blocked on a peer that does not receive"
            pair.send("go", dest=1, tag=5)
            pair.recv(source=1, tag=6)
        else:
            go = pair.irecv(source=0, tag=5)
            while not go.test()[0]:
                time.sleep(0.001)
            _until(lambda: (channel.poll(), channel.counts()[0] == 1)[1], "the message never came")
            (got,) = channel.take(0, 1)
            assert np.array_equal(got, records)
            pair.send("done", dest=0, tag=6)
    finally:
        channel.close()
        pair.Free()
