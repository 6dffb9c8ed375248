"""Directory messages between replicas (rule R4), point-to-point on the cross-replica
communicator: TP rank t of each replica sends its replica's host-tier changes to TP
rank t of every other replica that is not a node peer (those read the node directory,
``node_directory``, where the same changes are listed instead), one message per peer
every few steps (none when nothing changed). Without such peers nothing is sent or
probed for. Nothing blocks: sends are ``Isend`` (buffers kept until complete), receives
are matched with ``Improbe`` and completed with ``Imrecv``, at step boundaries.

MPI keeps the messages of one sender in order, so "the first k messages of peer p"
is the same set on every TP rank of a replica; ``counts`` says how many each rank has
whole, the TP group MIN-reduces those counts, and every rank applies exactly that
prefix (``take``). Delivery timing can differ between TP ranks; what they apply cannot.

A message's first row is a header: the job's token (agreed at start-up). A message of
an earlier cache in the same processes, never received before that cache closed, can
match this one's receives (MPI reuses a freed communicator's context); it is dropped
unseen, on every rank alike, before it is counted — at once when its sender is no
peer that sends to this cache (the earlier cache had other replicas or other node
peers)."""

from __future__ import annotations

from collections import deque

import numpy as np

from .comm import keep_alive
from .directory import RECORD_WORDS
from .node_directory import NodeDirectory

DIRECTORY_TAG = 11


class DirectoryChannel:
    """This rank's directory traffic with its peers (``cross``: the cross-replica
    communicator, whose rank is the replica index): messages with ``peers`` (default:
    every other replica), entries in ``node`` (the node directory, None without node
    peers)."""

    def __init__(self, cross, me: int, num_replicas: int, token: int = 0,
                 peers: tuple[int, ...] | None = None, node: NodeDirectory | None = None):
        from mpi4py import MPI

        self.MPI = MPI
        self.cross, self.me, self.num_replicas = cross, me, num_replicas
        self.peers = tuple(p for p in range(num_replicas) if p != me) if peers is None else peers
        self.node = node
        self._senders = frozenset(self.peers)
        self._dropping: list[tuple] = []  # (request, buffer) of messages of an earlier cache
        self.token = token
        self._status = MPI.Status()
        self.header = np.array([[token, num_replicas, me]], dtype=np.uint64)
        self._sending: deque[tuple] = deque()  # (request, buffer) of sends not complete
        self._inbox: list[deque] = [deque() for _ in range(num_replicas)]  # (request, buffer) per peer
        self.taken = np.zeros(num_replicas, dtype=np.int64)  # messages handed out, per peer
        self.held: np.ndarray | None = None  # tests: counts frozen (a delivery delay)
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.stale_dropped = 0  # messages of an earlier cache
        self._open = 0  # messages matched, not yet handed out

    def send(self, records: np.ndarray) -> None:
        """List one boundary's records in the node directory and send them to every
        message peer (nothing when there are none). The TP ranks of a replica have the
        same records at the same boundaries, so they count the node epochs alike."""
        if len(records) == 0:
            return
        if self.node is not None:
            w = records[:, 0]
            self.node.advance((w >> np.uint64(1)).astype(np.int64), (w & np.uint64(1)) != 0,
                              records[:, 1], records[:, 2])
        if self.peers:
            self._post(records)

    def _post(self, records: np.ndarray) -> None:
        buf = np.concatenate((self.header, records)).view(np.uint8)
        for peer in self.peers:
            req = self.cross.Isend([buf, self.MPI.BYTE], dest=peer, tag=DIRECTORY_TAG)
            self._sending.append((req, buf))
            self.messages_sent += 1
            self.bytes_sent += buf.nbytes
        self._reap()

    def _reap(self) -> None:
        while self._sending and self._sending[0][0].Test():
            self._sending.popleft()
        if self._dropping:
            self._dropping = [(req, buf) for req, buf in self._dropping if not req.Test()]

    def poll(self) -> None:
        """Match every message that has arrived (non-blocking) and reap finished sends.
        Nothing to do without message peers (none can send to this rank)."""
        if not self.peers:
            return
        MPI, status = self.MPI, self._status
        while True:
            msg = self.cross.Improbe(source=MPI.ANY_SOURCE, tag=DIRECTORY_TAG, status=status)
            if msg is None:
                break
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            source, req = status.Get_source(), msg.Irecv([buf, MPI.BYTE])
            if source not in self._senders:  # an earlier cache's, laid out otherwise: dropped
                self._dropping.append((req, buf))
                self.stale_dropped += 1
                continue
            self._inbox[source].append((req, buf))
            self.messages_received += 1
            self._open += 1
        self._reap()

    def counts(self, read_node: bool = True) -> np.ndarray:
        """Per peer: messages this rank has whole, counted from the first ever sent;
        for a node peer, the epoch it has published in the node directory — or, without
        ``read_node``, the largest count, so that a MIN over the TP group takes the
        ranks' that read it (one rank reads the directory for the group)."""
        out = self.taken.copy()
        if self.node is not None:
            if read_node:
                self.node.observe(out)
            else:
                self.node.leave_to_others(out)
        if self._open:
            for peer, box in enumerate(self._inbox):
                whole = 0
                while whole < len(box):
                    req, buf = box[whole]
                    if not req.Test():
                        break
                    if int(buf[:8].view(np.uint64)[0]) != self.token:
                        del box[whole]  # an earlier cache's: dropped unseen
                        self._open -= 1
                        self.stale_dropped += 1
                        continue
                    whole += 1
                out[peer] += whole
        if self.held is not None:
            out = np.minimum(out, self.held)
        return out

    def take(self, peer: int, upto: int) -> list[np.ndarray]:
        """The record arrays of ``peer``'s messages up to number ``upto`` (all whole)."""
        out = []
        box = self.taken
        while box[peer] < upto:
            req, buf = self._inbox[peer].popleft()
            assert req.Test(), "taking a message that is not whole"
            rows = buf.view(np.uint64).reshape(-1, RECORD_WORDS)
            assert int(rows[0, 0]) == self.token, "taking a message of an earlier cache"
            out.append(rows[1:])
            box[peer] += 1
            self._open -= 1
        return out

    def agreed(self, counts: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """What the TP group agreed on (``counts``, as ``counts`` gives them): the node
        peers are read at their agreed epochs from now on; the message peers' records
        up to their agreed numbers, as ``(peer, records)`` in order."""
        if self.node is not None:
            self.node.use(counts)
        return [(peer, records) for peer in self.peers for records in self.take(peer, int(counts[peer]))]

    def hold(self, on: bool) -> None:
        """Tests: freeze (or thaw) the counts this rank reports, as if later messages
        (and node epochs) were still on their way to it."""
        self.held = self.counts() if on else None

    def close(self) -> None:
        """Cancel the receives still open, unmap the node directory. Sends not complete
        (a peer that is slow, stopped or gone) keep their buffers for the rest of the
        process."""
        self._reap()
        for box in self._inbox:
            for req, buf in box:
                if not req.Test():
                    req.Cancel()
                    keep_alive(req, buf)
        if self._sending or self._dropping:
            keep_alive(*self._sending, *self._dropping)
        self._inbox = [deque() for _ in range(self.num_replicas)]
        self._sending = deque()
        if self.node is not None:
            self.node.close()
