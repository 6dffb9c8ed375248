"""Committing the remote tier at start-up (after the consensus of docs/design.md, "Start-up"): on all
ranks or on none.

```
before the build: one allgather of (job token, node) — the host tier of a rank with a
                  peer replica on its node goes into a shared-memory file named by the token
after commit:     each rank opens its stamps, maps the shared host tiers and stamps of the
                  peers on its node (same TP index), builds its transports and directory
                  all ranks: allgather of (node, files, errors); MAX-reduce of "failed"
                  any rank failed -> every rank drops its remote parts, one warning names why
                  else every rank removes its files' names (the peers have them mapped)
```

Every rank reaches every collective whatever fails locally. A rank whose host tier did
not fit in /dev/shm keeps it in private memory; the peers then fetch from it with MPI
messages, and rank 0 says so in one warning line."""

from __future__ import annotations

import os
import secrets
import warnings
from dataclasses import dataclass

import torch

from .. import faults
from ..backend import simulate_async
from ..blocks import GPU, HOST
from ..config import CacheConfig
from ..storage import HostPool
from .comm import MpiComm
from .consensus import InitStatus
from .directory import Directory
from .directory_channel import DirectoryChannel
from .message_server import MessageServer
from .message_transport import MessageTransport
from .peer_copy import make_copier
from .remote import LocalSlots, RemoteTier, shm_dir
from .remote_rules import REMOTE_RULES, RemoteRules
from .replicas import ReplicaComms, ReplicaLayout
from .shared_transport import SharedTransport
from .stamps import SlotStamps


class RemoteTierWarning(UserWarning):
    """The remote tier is off, or some peers are reached by MPI messages instead of
    shared memory; the message says why."""


@dataclass(frozen=True, slots=True)
class SharePlan:
    """Decided before the tiers are built: where this rank's host tier lives."""

    token: int
    nodes: tuple[int, ...]  # node of every world rank
    host_path: str | None  # shared-memory file for this rank's host tier, None: private memory

    def stamps_path(self, rank: int) -> str:
        return os.path.join(shm_dir(), f"kvdist-{self.token:016x}-{rank}.stamps")


def wanted(cfg: CacheConfig, layout: ReplicaLayout) -> bool:
    return cfg.distributed.remote.enabled and layout.num_replicas > 1


def plan_sharing(comm: MpiComm, cfg: CacheConfig, layout: ReplicaLayout) -> SharePlan:
    """Collective over the world (when the remote tier is wanted): the job's token and
    every rank's node; this rank's host tier is shared when a peer replica's rank with
    the same TP index is on its node."""
    mine = secrets.randbits(62)
    table = comm.allgather_ints([mine, comm.node.node], "remote tier: job token and nodes")
    token, nodes = int(table[0, 0]), tuple(int(n) for n in table[:, 1])
    me = nodes[layout.rank]
    peers_here = any(nodes[layout.world_rank(r, layout.tp_rank)] == me
                     for r in range(layout.num_replicas) if r != layout.replica)
    share = peers_here and cfg.distributed.remote.transport == "auto"
    path = os.path.join(shm_dir(), f"kvdist-{token:016x}-{layout.rank}.host") if share else None
    return SharePlan(token, nodes, path)


def _peer_on_node(plan: SharePlan, layout: ReplicaLayout, peer: int, info: dict) -> bool:
    rank = layout.world_rank(peer, layout.tp_rank)
    return (plan.nodes[rank] == plan.nodes[layout.rank] and info["host"] is not None
            and info["stamps"] is not None)


def commit_remote(comm: MpiComm, replicas: ReplicaComms, cfg: CacheConfig, plan: SharePlan,
                  status: InitStatus, host: HostPool | None, gpu_raw: torch.Tensor, executor,
                  device: torch.device, slots: LocalSlots, capacity: dict[int, int],
                  rules: frozenset[str] | None = None) -> RemoteTier | None:
    """Build the remote tier on every rank or on none (collective over the world).
    ``rules``: the names of the ones it enforces (None: all, ``REMOTE_RULES``)."""
    layout = replicas.layout
    if status != InitStatus.KEEP_HOST or host is None:
        if layout.rank == 0:
            warnings.warn("kvdist: the remote tier is off: the job runs without a host tier "
                          f"({status.name})", RemoteTierWarning, stacklevel=3)
        return None
    stamps: SlotStamps | None = None
    built: list = []  # what this rank mapped and opened, undone if the tier is not committed
    tier: RemoteTier | None = None
    error: str | None = None
    try:
        stamps_path = plan.stamps_path(layout.rank) if host.shared_path else None
        stamps = SlotStamps(host.num_blocks, stamps_path)
    except Exception as e:  # a stamps file that cannot be had: peers use messages
        error = f"{type(e).__name__}: {e}"
    info = {"host": host.shared_path if stamps is not None and stamps.shared_path else None,
            "stamps": stamps.shared_path if stamps is not None else None,
            "shm_error": host.shared_error, "error": error}
    infos = comm.allgather(info, "remote tier: host tier files")
    enforced = RemoteRules.named(REMOTE_RULES if rules is None else rules)
    if error is None:
        try:
            tier = _build(comm, replicas, cfg, plan, infos, host, stamps, gpu_raw, executor,
                          device, slots, capacity, built, enforced)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    failed = comm.allreduce_max(int(error is not None), "remote tier: commit")
    if failed:
        reasons = comm.allgather(error, "remote tier: reasons")
        for thing in reversed(built):
            thing.close()
        if stamps is not None:
            stamps.close()
        host.memory.unlink()
        if layout.rank == 0:
            why = "; ".join(f"rank {r}: {e}" for r, e in enumerate(reasons) if e)
            warnings.warn(f"kvdist: the remote tier is off on all {comm.size} ranks: {why}",
                          RemoteTierWarning, stacklevel=3)
        return None
    host.memory.unlink()  # every peer has mapped it
    stamps.unlink()
    misses = [r for r, i in enumerate(infos) if i["shm_error"]]
    if misses and layout.rank == 0:
        warnings.warn(f"kvdist: /dev/shm could not hold the host tier of rank(s) "
                      f"{', '.join(map(str, misses))} ({infos[misses[0]]['shm_error']}): remote "
                      f"fetches from them go through MPI messages", RemoteTierWarning, stacklevel=3)
    return tier


def _build(comm, replicas: ReplicaComms, cfg: CacheConfig, plan: SharePlan, infos: list[dict],
           host: HostPool, stamps: SlotStamps, gpu_raw, executor, device, slots: LocalSlots,
           capacity: dict[int, int], built: list, rules: RemoteRules) -> RemoteTier:
    """Transports per peer replica: shared memory with peers on this node whose host
    tier is in a shared file, MPI messages with every other. The message server exists
    in any case: it answers the peers that reach this rank by messages. The copier of
    the shared transport is the variant of this cache's executor (``make_copier``)."""
    layout = replicas.layout
    rc = cfg.distributed.remote
    fail = faults.active("remote_fetch", layout.rank)
    server = MessageServer(replicas.cross, host.raw, stamps, rules.check_stamps)
    built.append(server)
    messages = MessageTransport(replicas.cross, host.raw, slots, executor, fail,
                                first_id=plan.token & ((1 << 48) - 1))
    copier = None
    transports = {}
    for peer in range(layout.num_replicas):
        if peer == layout.replica:
            continue
        info = infos[layout.world_rank(peer, layout.tp_rank)]
        if rc.transport == "auto" and _peer_on_node(plan, layout, peer, info):
            pool = HostPool(host.layout, host.num_blocks, pin=device.type == "cuda", device=device,
                            chunk_bytes=cfg.cache.host.chunk_bytes, shared_path=info["host"],
                            attach=True, rank=layout.rank)
            built.append(pool)
            peer_stamps = SlotStamps(host.num_blocks, info["stamps"], attach=True)
            built.append(peer_stamps)
            if copier is None:
                copier = make_copier(device, simulate_async(cfg), executor)
                built.append(copier)
            transports[peer] = SharedTransport(pool, peer_stamps, {GPU: gpu_raw, HOST: host.raw}, copier,
                                               slots, rules.check_stamps, fail)
        else:
            transports[peer] = messages
    channel = DirectoryChannel(replicas.cross, layout.replica, layout.num_replicas, plan.token)
    return RemoteTier(tp=replicas.tp, channel=channel,
                      directory=Directory(layout.num_replicas, layout.replica, host.num_blocks),
                      stamps=stamps, transports=transports, server=server, rules=rules, slots=slots,
                      fetch_timeout_s=rc.fetch_timeout_ms / 1000, replica=layout.replica,
                      num_replicas=layout.num_replicas, bytes_per_block=host.layout.bytes_per_block,
                      capacity=capacity, directory_every=rc.directory_every_steps)


__all__ = ["RemoteTierWarning", "SharePlan", "commit_remote", "plan_sharing", "wanted"]
