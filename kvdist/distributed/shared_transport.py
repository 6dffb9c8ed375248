"""The one-node transport: a peer replica's host tier is a shared-memory file this
rank has mapped (pinned too, on CUDA), so a fetch is a copy straight from the peer's
slots — into this rank's GPU slots for ``add_sequence``'s own fetch (a DMA at
host->GPU speed), into its host slots for a prefetch — with no MPI and no help from
the peer. A stopped or dead peer therefore never delays a fetch (R3); its stamps,
mapped from the peer's stamp file, tell whether the bytes copied were the block
wanted (R2: a ``GuardedRead`` around the copy).

How the copy runs is the ``PeerCopier`` chosen when the tier was built
(``kvdist.distributed.peer_copy``)."""

from __future__ import annotations

import numpy as np
import torch

from ..blocks import GPU, HOST
from ..storage import HostPool
from .peer_copy import CopyOp, PeerCopier
from .stamps import GuardedRead, SlotStamps
from .transport import Batch, Fetcher, LandingSlots, Transfer

__all__ = ["PeerCopy", "SharedTransport"]


class PeerCopy(Transfer):
    """A batch's copy out of the peer's mapping: the copy, the blocks it carries (their
    indices in the batch), and the stamps' reading around it."""

    __slots__ = ("idx", "op", "read")

    def __init__(self, where: np.ndarray, idx: np.ndarray, op: CopyOp, read: GuardedRead):
        super().__init__(where)
        self.idx, self.op, self.read = idx, op, read


class SharedTransport(Fetcher[PeerCopy]):
    """Fetches from one peer on this node through its mapped host tier (see the module
    docstring). ``check_stamps``: rule R2 (the remote tier's rules, read once)."""

    name = "shared"

    def __init__(self, peer_pool: HostPool, peer_stamps: SlotStamps, landing: dict[int, torch.Tensor],
                 copier: PeerCopier, slots: LandingSlots, check_stamps: bool = True, fail: bool = False):
        super().__init__(slots, fail)
        self.peer_pool, self.peer_stamps = peer_pool, peer_stamps
        self.landing = landing  # tier -> its uint8 [slots, bytes] memory
        self.copier = copier
        self.check_stamps = check_stamps

    def landing_tier(self, prefetch: bool) -> int:
        """add_sequence's own fetch lands straight in the GPU tier (its blocks take the
        GPU slots the prompt needs anyway); a prefetch in the host tier (it must not
        hold GPU slots a step's sequences need), onboarded at admission like a host hit.
        A prefetch leaves out the blocks of node peers (``RemoteTier.near``):
        add_sequence's DMA costs what a host onboard does."""
        return HOST if prefetch else GPU

    def _begin(self, batch: Batch, deps: list) -> PeerCopy:
        read = self.peer_stamps.read_guarded(batch.peer_slots, batch.hi, batch.lo, self.check_stamps)
        batch.finish(~read.ok, np.zeros(len(batch), dtype=bool))  # stale already: nothing to copy
        idx = np.flatnonzero(read.ok)
        tier = batch.tier
        op = self.copier.start(self.peer_pool.raw, self.landing[tier], batch.peer_slots[idx],
                               batch.dst[idx] - self.slots.tier_base(tier), deps,
                               to_gpu=tier == GPU, src_chunk=self.peer_pool.chunk_blocks)
        return PeerCopy(read.ok.copy(), idx, op, read)

    def _began(self, batch: Batch, t: PeerCopy) -> float | None:
        return t.op.began()  # a copy queued behind this rank's others is not late

    def _complete(self, t: PeerCopy) -> bool:
        return t.op.done()

    def _good(self, batch: Batch, t: PeerCopy) -> np.ndarray:
        return t.read.verify()  # the blocks copied whose stamps did not move meanwhile

    def _cancel(self, t: PeerCopy) -> bool:
        return t.op.cancel()

    def _close(self, open_: list[PeerCopy]) -> None:
        self.copier.close()  # no copy may still read the mapping
        self.landing = {}  # this rank's tiers: they are unmapped next
        self.peer_stamps.close()
        self.peer_pool.close()
