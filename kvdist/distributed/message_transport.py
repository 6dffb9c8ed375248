"""The transport between nodes (and wherever no shared mapping exists), the fetcher's
side: MPI messages on the cross-replica communicator, shard-aligned (TP rank t asks
TP rank t). The holder's side is ``message_server.MessageServer``; the wire format is
``message_wire``.

A fetch is one request per batch, answered by the holder with one message per block,
sent straight from its host slot and received straight into the fetcher's landing
host slot (no packing copy on either side), then a trailer: which blocks were good.
(One message over an indexed datatype was measured 30x slower than this with MPICH
5.0.2 on one node: 0.1 GB/s against 2.2 for 128 KiB blocks.) The fetcher never lands
a block without a trailer of its request saying it was good (R2).

Past its deadline (``fetch_timeout_ms``) a batch is given up: its receives are
cancelled; a receive already under way cannot be, and keeps its landing slot until it
completes (the slots are freed only then). Late or cancelled answers are drained. A
stopped or slow holder thus costs misses, never a stalled step (R3)."""

from __future__ import annotations

from collections import deque

import numpy as np

from ..blocks import HOST
from .comm import keep_alive
from .message_wire import REQUEST_TAG, encode_request, tags, trailer_size, trailer_verdict
from .peer_copy import HostWaiter
from .transport import Batch, Fetcher, LandingSlots, Transfer

__all__ = ["Answer", "MessageTransport"]


class Answer(Transfer):
    """The fetcher's receives of one answer: one per block, then the trailer."""

    __slots__ = ("blocks", "cancelled", "next", "peer", "rid", "tail", "trailer")

    def __init__(self, where: np.ndarray, rid: int, peer: int, blocks: list, tail, trailer: np.ndarray):
        super().__init__(where)
        self.rid, self.peer, self.blocks, self.tail, self.trailer = rid, peer, blocks, tail, trailer
        self.next = 0  # blocks before this one are received (they arrive in order)
        self.cancelled = [0, 0]  # receives cancelled: of blocks, of the trailer

    def complete(self, MPI) -> bool:
        """Whether every receive completed (received or cancelled); notes cancellations.
        Tests from the first open block receive on (one Test a call when nothing came)."""
        blocks, status = self.blocks, MPI.Status()
        while self.next < len(blocks):
            if not blocks[self.next].Test(status):
                return False
            self.cancelled[0] += status.Is_cancelled()
            self.next += 1
        if self.tail is not None:
            status = MPI.Status()
            if not self.tail.Test(status):
                return False
            self.cancelled[1] = int(status.Is_cancelled())
            self.tail = None
        return True

    def cancel(self) -> None:
        for req in (*self.blocks[self.next:], self.tail):
            if req is not None and req:  # a completed request is MPI_REQUEST_NULL
                req.Cancel()


class MessageTransport(Fetcher[Answer]):
    """Fetch requests over ``cross`` into this rank's host tier ``host_raw`` (uint8
    ``[slots, bytes]``); ``host_waits`` is the executor, whose copies of the landing
    slots the host waits for before MPI may write them (S2)."""

    name = "messages"

    def __init__(self, cross, host_raw, slots: LandingSlots, host_waits: HostWaiter, fail: bool = False,
                 first_id: int = 0):
        from mpi4py import MPI

        super().__init__(slots, fail)
        self.MPI = MPI
        self.cross = cross
        self.host = host_raw.numpy()  # [slots, bytes] uint8: the landing memory
        self.host_base = slots.tier_base(HOST)
        self.host_waits = host_waits
        # Request ids start at the job's token: an answer of an earlier cache in the same
        # processes (MPI reuses a freed communicator's context) carries another id, so its
        # trailer never vouches for this cache's blocks, and its tags almost never match.
        self._next_id = first_id
        self._sends: deque[tuple] = deque()  # (request, keep-alive) of requests not sent yet
        self._stray: list[tuple[int, int, int]] = []  # (peer, tag, messages) given up on, to drain

    def landing_tier(self, prefetch: bool) -> int:
        return HOST  # MPI writes host memory

    def _begin(self, batch: Batch, deps: list) -> Answer:
        MPI, cross, peer = self.MPI, self.cross, batch.peer
        rid = self._next_id
        self._next_id += 1
        data_tag, trailer_tag = tags(rid)
        self.host_waits.wait_host(deps)  # S2: nothing of the engine touches them once MPI can
        # The request goes first: the holder posts its sends while this rank posts the
        # receives (a few µs each), and the answer's messages, matched by their own tag,
        # wait for them (MPI keeps them in order).
        request = encode_request(rid, batch.peer_slots, batch.hi, batch.lo)
        self._sends.append((cross.Isend([request, MPI.INT64_T], dest=peer, tag=REQUEST_TAG), request))
        host = self.host
        blocks = [cross.Irecv([host[s], MPI.BYTE], source=peer, tag=data_tag)
                  for s in (batch.dst - self.host_base).tolist()]
        trailer = np.empty(trailer_size(len(batch)), dtype=np.uint8)
        tail = cross.Irecv([trailer, MPI.BYTE], source=peer, tag=trailer_tag)
        return Answer(np.ones(len(batch), dtype=bool), rid, peer, blocks, tail, trailer)

    def _complete(self, a: Answer) -> bool:
        if not a.complete(self.MPI):
            return False
        for tag, count in zip(tags(a.rid), a.cancelled):
            if count:  # those messages may still come: drain them then
                self._stray.append((a.peer, tag, count))
        a.cancelled = [0, 0]
        return True

    def _good(self, batch: Batch, a: Answer) -> np.ndarray:
        if a.given_up:  # receives cancelled: whatever came is not vouched for
            return np.zeros(len(batch), dtype=bool)
        return trailer_verdict(a.trailer, a.rid)

    def _cancel(self, a: Answer) -> bool:
        a.cancel()
        return False  # a receive under way still writes: done once every receive is

    def progress(self) -> None:
        """Drain answers nobody waits for; reap sent requests (never blocks)."""
        if self._stray:
            self._drain()
        while self._sends and self._sends[0][0].Test():
            self._sends.popleft()

    def _drain(self) -> None:
        """Receive and drop answers to fetches given up on (they would sit in MPI's
        queue of unexpected messages forever)."""
        MPI, status = self.MPI, self.MPI.Status()
        left = []
        for peer, tag, count in self._stray:
            while count and (msg := self.cross.Improbe(source=peer, tag=tag, status=status)) is not None:
                scratch = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                self._sends.append((msg.Irecv([scratch, MPI.BYTE]), scratch))  # reaped like a send
                count -= 1
            if count:
                left.append((peer, tag, count))
        self._stray = left

    def _close(self, open_: list[Answer]) -> None:
        """Whatever MPI may still write or read — a receive under way, a request to a
        stopped peer — keeps its requests and the host tier's memory alive for the rest
        of the process (the tier is unregistered, never unmapped under MPI)."""
        pending = [(a.blocks, a.tail, a.trailer) for a in open_] + list(self._sends)
        if pending:
            keep_alive(pending, self.host)
        self._sends, self._stray = deque(), []
        self.host = None
