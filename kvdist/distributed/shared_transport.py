"""The one-node transport: a peer replica's host tier is a shared-memory file this
rank has mapped (pinned too, on CUDA), so a fetch is a copy straight from the peer's
slots — into this rank's GPU slots for ``add_sequence``'s own fetch (a DMA at
host->GPU speed), into its host slots for a prefetch — with no MPI and no help from
the peer. A stopped or dead peer therefore never delays a fetch (R3); its stamps,
mapped from the peer's stamp file, tell whether the bytes copied were the block
wanted (R2).

How the copy runs follows the executor (``PeerCopier``): at once (CPU), queued on the
simulated "remote" stream (CPU, ``simulate_async``: tests hold that stream to let a
holder overwrite a slot mid-fetch), or, on CUDA, on a stream of its own that first
waits for whatever the landing slots still take part in (S2, S4)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..blocks import GPU, HOST
from ..storage import HostPool
from .fetch import FAILED, TIMED_OUT, Batch
from .stamps import SlotStamps


def _copy_rows(dst: np.ndarray, src: np.ndarray, pairs: list[tuple[int, int]]) -> None:
    """``dst[b] = src[a]`` for every pair: one memcpy a block (numpy's row copies run at
    memory speed; torch's ``index_select``/``index_copy_`` on uint8 rows does not)."""
    for a, b in pairs:
        dst[b] = src[a]


class _Cancelled:
    __slots__ = ("flag",)

    def __init__(self) -> None:
        self.flag = False


class PeerCopier:
    """Copies ``src[s_idx] -> dst[d_idx]`` (uint8 ``[blocks, bytes]`` tensors, ``src`` a
    peer's mapped host tier) after ``deps`` (the landing slots' pending events), the
    way ``executor`` runs copies:

    * into CUDA memory: a batched DMA on a stream of its own, after ``deps`` on the GPU;
    * into host memory beside a CUDA executor: a memcpy on a worker thread (the
      scheduler's thread does not wait for it);
    * on a CPU cache: at once, or queued on the simulated "remote" stream."""

    def __init__(self, executor, device: torch.device):
        self.executor = executor
        self.cuda = hasattr(executor, "stream_wait")  # a CUDA executor (the CUDA device's)
        self.simulated = hasattr(executor, "enqueue")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvdist-remote") if self.cuda else None

    def start(self, src: torch.Tensor, dst: torch.Tensor, s_idx: np.ndarray, d_idx: np.ndarray,
              deps: list, to_gpu: bool, src_chunk: int = 0):
        """Copy into ``dst``, which is the GPU tier when ``to_gpu``."""
        if self.cuda and to_gpu:
            self.executor.stream_wait(self.stream, deps)
            self.executor.copier.copy(self.stream, src, dst, s_idx, d_idx, src_chunk=src_chunk)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            return ev
        pairs = list(zip(s_idx.tolist(), d_idx.tolist()))
        if self._pool is not None:
            self.executor.wait_host(deps)
            return self._pool.submit(_copy_rows, dst.numpy(), src.numpy(), pairs)
        if not self.simulated:
            self.executor.wait_host(deps)
            _copy_rows(dst.numpy(), src.numpy(), pairs)
            return None
        cancelled = _Cancelled()

        def run() -> None:
            if not cancelled.flag:
                _copy_rows(dst.numpy(), src.numpy(), pairs[::-1])  # no order inside a batch
        return self.executor.enqueue("remote", run, deps), cancelled

    def done(self, handle) -> bool:
        """Whether the copy has run (runs a simulated one unless its stream is held)."""
        if handle is None:
            return True
        if isinstance(handle, tuple):
            op, _ = handle
            if not op.done and not self.executor.streams["remote"].held:
                self.executor.force(op)
            return op.done
        if isinstance(handle, Future):
            if handle.done():
                handle.result()  # a worker's error surfaces here
                return True
            return False
        return handle.query()

    def cancel(self, handle) -> bool:
        """Stop a copy that has not run; True when it will never write. Only a simulated
        copy can be stopped: a DMA or memcpy already queued always runs (and soon)."""
        if isinstance(handle, tuple):
            handle[1].flag = True
            return True
        return handle is None

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class SharedTransport:
    """Fetches from one peer on this node through its mapped host tier (see the module
    docstring). ``rules`` is the remote tier's live rule set ("R2": check stamps)."""

    name = "shared"
    serves = False  # the holder takes no part

    def __init__(self, peer_pool: HostPool, peer_stamps: SlotStamps, landing: dict[int, torch.Tensor],
                 copier: PeerCopier, slots, rules: set[str], fail: bool = False):
        self.peer_pool, self.peer_stamps = peer_pool, peer_stamps
        self.landing = landing  # tier -> its uint8 [slots, bytes] memory
        self.copier = copier
        self.slots = slots  # LocalSlots: the landing slots' pending events
        self.rules = rules
        self.fail = fail  # fault drill remote_fetch: every fetch of this rank fails

    def landing_tier(self, prefetch: bool) -> int:
        """add_sequence's own fetch lands straight in the GPU tier (its blocks take the
        GPU slots the prompt needs anyway); a prefetch in the host tier (it must not
        hold GPU slots a step's sequences need), onboarded at admission like a host hit."""
        return HOST if prefetch else GPU

    def start(self, batch: Batch) -> None:
        n = len(batch)
        if self.fail:
            batch.give_up(np.ones(n, dtype=bool), FAILED, done=True)
            return
        check = "R2" in self.rules
        if check:
            gen, ok = self.peer_stamps.before(batch.peer_slots, batch.hi, batch.lo)
            batch.finish(~ok, np.zeros(n, dtype=bool))  # stale already: nothing to copy
        else:
            gen, ok = None, np.ones(n, dtype=bool)
        idx = np.flatnonzero(ok)
        dst = batch.dst[idx]
        tier = batch.tier
        handle = self.copier.start(self.peer_pool.raw, self.landing[tier], batch.peer_slots[idx],
                                   dst - self.slots.tier_base(tier), self.slots.pending_events(dst),
                                   to_gpu=tier == GPU, src_chunk=self.peer_pool.chunk_blocks)
        batch.handle = (handle, idx, gen, check)
        self.poll(batch, 0.0)

    def poll(self, batch: Batch, now: float) -> None:
        if batch.handle is None:
            return
        handle, idx, gen, check = batch.handle
        where = np.zeros(len(batch), dtype=bool)
        where[idx] = True
        if self.copier.done(handle):
            good = np.ones(len(batch), dtype=bool)
            if check:
                good[idx] = self.peer_stamps.unchanged(batch.peer_slots[idx], gen[idx])
            batch.finish(where, good)
            batch.handle = None
        elif now > batch.deadline and self.copier.cancel(handle):
            batch.give_up(where, TIMED_OUT, done=True)
            batch.handle = None

    def service(self) -> None:
        pass  # the peer takes no part in a shared-memory fetch

    def close(self) -> None:
        self.copier.close()  # no copy may still read the mapping
        self.landing = {}  # this rank's tiers: they are unmapped next
        self.peer_stamps.close()
        self.peer_pool.close()
