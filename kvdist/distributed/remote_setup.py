"""Committing the remote tier at start-up (after the consensus of docs/design.md, "Start-up"): on all
ranks or on none.

```
before the build: one allgather of (job token, node) — the host tier of a rank with a
                  peer replica on its node goes into a shared-memory file named by the token
after commit:     each rank opens its stamps; the node's first rank creates the node
                  directory (when two or more replicas are whole on the node)
                  all ranks: allgather of (node, files, errors); each rank maps the shared
                  host tiers and stamps of the peers on its node (same TP index) and, with
                  node peers, the node directory; builds its transports and directory
                  all ranks: MAX-reduce of "failed"
                  any rank failed -> every rank drops its remote parts, one warning names why
                  else every rank removes its files' names (the peers have them mapped)
```

Two replicas are *node peers* when every rank of both is on one node with its host
tier and stamps in shared memory, and the node directory exists: they list their
blocks for each other in the node directory (``node_directory``) and send each other
no directory messages; a rank that no peer reaches by messages never probes for
fetch requests.

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
from .node_directory import NodeDirectory, NodeShape
from .peer_copy import make_copier
from .remote import RemoteTier, shm_dir
from .remote_plan import LocalSlots
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

    def node_replicas(self, layout: ReplicaLayout) -> tuple[int, ...]:
        """The replicas that have every rank on this rank's node."""
        here = self.nodes[layout.rank]
        return tuple(r for r in range(layout.num_replicas)
                     if all(self.nodes[layout.world_rank(r, t)] == here for t in range(layout.tp_size)))

    def node_directory(self, layout: ReplicaLayout, host_slots: int) -> tuple[int, str, NodeShape] | None:
        """(the rank that creates it, its file, its shape) of this rank's node
        directory; None when fewer than two replicas are whole on this node."""
        replicas = self.node_replicas(layout)
        if len(replicas) < 2:
            return None
        creator = layout.world_rank(replicas[0], 0)
        return (creator, os.path.join(shm_dir(), f"kvdist-{self.token:016x}-{creator}.node"),
                NodeShape(replicas, layout.tp_size, host_slots))


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


def attach_peer_host(cfg: CacheConfig, host: HostPool, info: dict, device, rank: int,
                     built: list) -> tuple[HostPool, SlotStamps]:
    """A same-node peer's host tier and its stamps, attached from the paths it shared
    (``info``); both appended to ``built`` (closed with the set-up on failure)."""
    pool = HostPool(host.layout, host.num_blocks, pin=device.type == "cuda", device=device,
                    chunk_bytes=cfg.cache.host.chunk_bytes, shared_path=info["host"], attach=True, rank=rank)
    built.append(pool)
    stamps = SlotStamps(host.num_blocks, info["stamps"], attach=True)
    built.append(stamps)
    return pool, stamps


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
    created = _create_node_directory(cfg, plan, layout, host.num_blocks)
    try:
        info = {"host": host.shared_path if stamps is not None and stamps.shared_path else None,
                "stamps": stamps.shared_path if stamps is not None else None,
                "node": created.path if created is not None else None,
                "shm_error": host.shared_error, "error": error}
        infos = comm.allgather(info, "remote tier: host tier files")
        enforced = RemoteRules.named(REMOTE_RULES if rules is None else rules)
        if error is None:
            try:
                tier = _build(comm, replicas, cfg, plan, infos, host, stamps, gpu_raw, executor,
                              device, slots, capacity, built, enforced)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        faults.stall("remote_stall", layout.rank, comm.timeout_s)
        committed = commit_or_undo(comm, error, built, stamps, host, layout.rank, "remote tier")
    except BaseException:  # a collective timed out, a stop: no file of this rank stays
        for thing in reversed(built):
            thing.close()
        for shared in (stamps, created):
            if shared is not None:
                shared.close()  # removes its file, unless already unlinked
        raise  # the caller tears the candidate down, and with it the host tier's file
    if created is not None:  # every rank with node peers has it mapped (or failed)
        created.unlink()
        created.close()
    if not committed:
        return None
    misses = [r for r, i in enumerate(infos) if i["shm_error"]]
    if misses and layout.rank == 0:
        warnings.warn(f"kvdist: /dev/shm could not hold the host tier of rank(s) "
                      f"{', '.join(map(str, misses))} ({infos[misses[0]]['shm_error']}): remote "
                      f"fetches from them go through MPI messages", RemoteTierWarning, stacklevel=3)
    return tier


def commit_or_undo(comm, error: str | None, built: list, stamps: SlotStamps | None, host: HostPool,
                   rank: int, what: str) -> bool:
    """The start-up's commit (collective, ``what`` naming its steps): True when no rank
    had an ``error``; its files are unlinked, every peer having mapped them. Else every
    rank closes what it ``built`` (last first) and its stamps, unlinks its host tier's
    file, rank 0 warns once with each rank's reason, and False."""
    failed = comm.allreduce_max(int(error is not None), f"{what}: commit")
    if not failed:
        host.memory.unlink()  # every peer has mapped it
        stamps.unlink()
        return True
    reasons = comm.allgather(error, f"{what}: reasons")
    for thing in reversed(built):
        thing.close()
    if stamps is not None:
        stamps.close()
    host.memory.unlink()
    if rank == 0:
        why = "; ".join(f"rank {r}: {e}" for r, e in enumerate(reasons) if e)
        warnings.warn(f"kvdist: the remote tier is off on all {comm.size} ranks: {why}",
                      RemoteTierWarning, stacklevel=4)
    return False


def _create_node_directory(cfg: CacheConfig, plan: SharePlan, layout: ReplicaLayout,
                           host_slots: int) -> NodeDirectory | None:
    """The node directory's file, on the rank that creates it (None elsewhere, or when
    it cannot be had: the node's replicas then exchange messages)."""
    where = plan.node_directory(layout, host_slots)
    if where is None or where[0] != layout.rank or cfg.distributed.remote.transport != "auto":
        return None
    try:
        return NodeDirectory(where[1], where[2], layout.replica, layout.tp_rank, (), create=True)
    except Exception:  # no room in /dev/shm: messages
        return None


def _node_peers(cfg: CacheConfig, plan: SharePlan, layout: ReplicaLayout,
                infos: list[dict]) -> tuple[int, ...]:
    """This replica's node peers (see the module docstring): the same on its TP ranks,
    and symmetric, since every rank decides from the same table."""
    where = plan.node_directory(layout, 0)
    if where is None or cfg.distributed.remote.transport != "auto" or infos[where[0]]["node"] is None:
        return ()

    def shared(r: int) -> bool:
        return all(infos[layout.world_rank(r, t)]["host"] is not None
                   and infos[layout.world_rank(r, t)]["stamps"] is not None for t in range(layout.tp_size))

    replicas = plan.node_replicas(layout)
    if not shared(layout.replica):
        return ()
    return tuple(r for r in replicas if r != layout.replica and shared(r))


def _near(cfg: CacheConfig, plan: SharePlan, layout: ReplicaLayout, infos: list[dict]) -> frozenset[int]:
    """The peers that every TP rank of this replica reaches through shared memory (whose
    blocks add_sequence fetches itself, ``RemoteTier.near``): decided from the same
    table on every rank of the replica, so they prefetch alike (R1)."""
    if cfg.distributed.remote.transport != "auto":
        return frozenset()

    def shared(peer: int, t: int) -> bool:
        theirs = layout.world_rank(peer, t)
        return (plan.nodes[theirs] == plan.nodes[layout.world_rank(layout.replica, t)]
                and infos[theirs]["host"] is not None and infos[theirs]["stamps"] is not None)

    return frozenset(p for p in range(layout.num_replicas)
                     if p != layout.replica and all(shared(p, t) for t in range(layout.tp_size)))


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
            pool, peer_stamps = attach_peer_host(cfg, host, info, device, layout.rank, built)
            if copier is None:
                copier = make_copier(device, simulate_async(cfg), executor)
                built.append(copier)
            transports[peer] = SharedTransport(pool, peer_stamps, {GPU: gpu_raw, HOST: host.raw}, copier,
                                               slots, rules.check_stamps, fail)
        else:
            transports[peer] = messages
    node_peers = _node_peers(cfg, plan, layout, infos)
    node = None
    if node_peers:
        _, path, shape = plan.node_directory(layout, host.num_blocks)
        node = NodeDirectory(path, shape, layout.replica, layout.tp_rank, node_peers)
        built.append(node)
    others = tuple(p for p in range(layout.num_replicas) if p != layout.replica and p not in node_peers)
    channel = DirectoryChannel(replicas.cross, layout.replica, layout.num_replicas, plan.token,
                               peers=others, node=node)
    # Peers fetch from this rank by messages unless they share its node and its host tier.
    here = rc.transport == "auto" and infos[layout.rank]["host"] is not None \
        and infos[layout.rank]["stamps"] is not None
    serve = any(not (here and plan.nodes[layout.world_rank(p, layout.tp_rank)] == plan.nodes[layout.rank])
                for p in range(layout.num_replicas) if p != layout.replica)
    return RemoteTier(tp=replicas.tp, channel=channel, serve=serve,
                      directory=Directory(layout.num_replicas, layout.replica, host.num_blocks, node,
                                          mirrored=others),
                      stamps=stamps, transports=transports, server=server, rules=rules, slots=slots,
                      fetch_timeout_s=rc.fetch_timeout_ms / 1000, replica=layout.replica,
                      num_replicas=layout.num_replicas, bytes_per_block=host.layout.bytes_per_block,
                      capacity=capacity, directory_every=rc.directory_every_steps,
                      near=_near(cfg, plan, layout, infos))


__all__ = ["RemoteTierWarning", "SharePlan", "attach_peer_host", "commit_or_undo", "commit_remote",
           "plan_sharing", "wanted"]
