"""The holder's side of the message transport: answering peers' fetch requests out of
this rank's host tier (wire format: ``message_wire``).

The holder serves at its step boundaries (``service``), never blocking: it receives
the requests that came, sends each block straight from its host slot, and once those
sends are complete sends the trailer. Its stamps are read around the sends (R2, a
``GuardedRead``): a slot it reused between the first reading and the sends' completion
is reported stale, so the fetcher never lands it."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from .comm import keep_alive
from .message_wire import REQUEST_TAG, decode_request, encode_trailer, tags
from .stamps import GuardedRead, SlotStamps

__all__ = ["MessageServer"]


class _Serving:
    """An answer whose blocks are being sent."""

    __slots__ = ("read", "reqs", "rid", "src")

    def __init__(self, reqs: list, src: int, rid: int, read: GuardedRead):
        self.reqs, self.src, self.rid, self.read = reqs, src, rid, read


class MessageServer:
    """Answers the fetch requests peers send over ``cross`` from ``host_raw`` (uint8
    ``[slots, bytes]``), the host tier whose stamps are ``stamps``. ``check_stamps``:
    rule R2 (the remote tier's rules, read once)."""

    def __init__(self, cross, host_raw, stamps: SlotStamps, check_stamps: bool = True):
        from mpi4py import MPI

        self.MPI = MPI
        self.cross = cross
        self.host = host_raw.numpy()
        self.stamps = stamps
        self.check_stamps = check_stamps
        self._incoming: list[tuple] = []  # (request, buffer, source) of requests being received
        self._serving: list[_Serving] = []
        self._sends: deque[tuple] = deque()  # (request, keep-alive) of trailers not complete
        self._status = MPI.Status()
        self.requests_served = 0
        self.blocks_served = 0
        self.stale_served = 0

    def service(self) -> None:
        """Answer what peers asked (never blocks)."""
        MPI, status = self.MPI, self._status
        while (msg := self.cross.Improbe(source=MPI.ANY_SOURCE, tag=REQUEST_TAG, status=status)) is not None:
            buf = np.empty(status.Get_count(MPI.BYTE) // 8, dtype=np.int64)
            self._incoming.append((msg.Irecv([buf, MPI.INT64_T]), buf, status.Get_source()))
        if not (self._incoming or self._serving or self._sends):
            return  # nothing asked, nothing under way
        still = []
        for req, buf, src in self._incoming:
            if req.Test():
                self._answer(src, buf)
            else:
                still.append((req, buf, src))
        self._incoming = still
        serving = []
        for s in self._serving:
            reqs = s.reqs  # sends of one answer, tested from the first still open
            while reqs and reqs[-1].Test():
                reqs.pop()
            if reqs:
                serving.append(s)
            else:
                self._trail(s)
        self._serving = serving
        while self._sends and self._sends[0][0].Test():
            self._sends.popleft()

    def _answer(self, src: int, buf: np.ndarray) -> None:
        MPI = self.MPI
        rid, slots, hi, lo = decode_request(buf)
        inside = (slots >= 0) & (slots < len(self.host))
        safe = np.where(inside, slots, 0)
        read = self.stamps.read_guarded(safe, hi, lo, self.check_stamps)
        read.ok &= inside
        data_tag = tags(rid)[0]
        host = self.host
        reqs = [self.cross.Isend([host[s], MPI.BYTE], dest=src, tag=data_tag) for s in safe.tolist()]
        reqs.reverse()  # popped from the end as they complete, first sent first
        self._serving.append(_Serving(reqs, src, rid, read))
        self.requests_served += 1
        self.blocks_served += len(slots)

    def _trail(self, s: _Serving) -> None:
        """The blocks are sent: stamps read again, the trailer says which were good."""
        ok = s.read.verify()
        self.stale_served += int((~ok).sum())
        trailer = encode_trailer(s.rid, ok)
        self._sends.append((self.cross.Isend([trailer, self.MPI.BYTE], dest=s.src, tag=tags(s.rid)[1]),
                            trailer))

    def close(self, grace_s: float = 1.0) -> None:
        """Finish what peers asked for (serving them for up to ``grace_s``), cancel the
        rest. Whatever MPI may still read then — a send to a stopped peer — keeps its
        requests and the host tier's memory alive for the rest of the process (the
        tier is unregistered, never unmapped under MPI)."""
        deadline = time.monotonic() + grace_s
        while (self._serving or self._sends) and time.monotonic() < deadline:
            self.service()
        for req, _, _ in self._incoming:
            req.Cancel()
        pending = [(req, buf) for req, buf, _ in self._incoming]
        pending += [s.reqs for s in self._serving] + list(self._sends)
        if pending:
            keep_alive(pending, self.host)
        self._incoming, self._serving, self._sends = [], [], deque()
        self.host = None
