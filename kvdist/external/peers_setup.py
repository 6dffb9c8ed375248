"""Start-up of the remote tier under ``cache.gpu: external`` (``kvdist.external.peers``),
on every rank or on none, as ``kvdist.distributed.remote_setup`` does for kvdist's own
GPU tier:

```
before the build: ReplicaComms (the TP group, the cross-replica communicator) and
                  remote_setup.plan_sharing: the job token and every rank's node; the
                  host tier of a rank with a peer replica on its node goes into a
                  shared-memory file
after commit:     each rank opens its stamps; allgather of (files, errors); each rank
                  maps the shared host tier and stamps of the peers on its node (same
                  TP index) and builds its transports, directory and message server
                  MAX-reduce of "failed": any rank failed -> every rank drops its
                  remote parts, rank 0 warns once why; else the files' names go
```

Every replica mirrors every other's host tier in its directory, node peers too (the
node directory of kvdist's own GPU tier is not used here: messages only). Every rank
reaches every collective whatever fails locally."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import faults
from ..blocks import HOST
from ..config import CacheConfig
from ..distributed.consensus import InitStatus
from ..distributed.directory import Directory
from ..distributed.directory_channel import DirectoryChannel
from ..distributed.message_server import MessageServer
from ..distributed.message_transport import MessageTransport
from ..distributed.peer_copy import ImmediateCopier
from ..distributed.remote_rules import REMOTE_RULES, RemoteRules
from ..distributed.remote_setup import (
    RemoteTierWarning,
    SharePlan,
    attach_peer_host,
    commit_or_undo,
    plan_sharing,
    wanted,
)
from ..distributed.replicas import ReplicaComms, ReplicaLayout
from ..distributed.shared_transport import SharedTransport
from ..distributed.stamps import SlotStamps
from ..storage import HostPool
from .peers import PeerTier

__all__ = ["LANDING_BLOCKS", "Sharing", "commit_peers", "sharing"]

LANDING_BLOCKS = 256  # rows of a rank's landing area (fewer when its host tier is smaller)


@dataclass(frozen=True, slots=True)
class Sharing:
    """Decided before the tiers are built: the replicas and where the host tier lives."""

    replicas: ReplicaComms
    plan: SharePlan | None  # None: no remote tier (one replica, or distributed.remote off)


class _NoWaits:
    """The landing area's copies wait for nothing of the transfer engine (HostWaiter)."""

    def wait_host(self, events: list) -> None:
        assert not events, "the landing area has no pending copies of the transfer engine"


def sharing(comm, cfg: CacheConfig) -> Sharing:
    """Collective over ``comm`` (the library's communicator): the TP group and the
    cross-replica communicator of ``distributed.tp_size``, and, when the remote tier is
    wanted, the job token and nodes (``remote_setup.plan_sharing``)."""
    layout = ReplicaLayout.of(comm.rank, comm.size, cfg.distributed.tp_size)
    replicas = ReplicaComms(comm, layout)
    try:
        return Sharing(replicas, plan_sharing(comm, cfg, layout) if wanted(cfg, layout) else None)
    except BaseException:
        replicas.free()
        raise


def commit_peers(comm, share: Sharing, cfg: CacheConfig, status: InitStatus, host: HostPool | None,
                 device: torch.device, rules: frozenset[str] | None = None) -> PeerTier | None:
    """Build the remote tier on every rank or on none (collective over ``comm``)."""
    replicas, plan = share.replicas, share.plan
    layout = replicas.layout
    if plan is None:
        return None
    if status != InitStatus.KEEP_HOST or host is None:
        if layout.rank == 0:
            warnings.warn("kvdist: the remote tier is off: the job runs without a host tier "
                          f"({status.name})", RemoteTierWarning, stacklevel=3)
        return None
    built: list = []
    stamps: SlotStamps | None = None
    error: str | None = None
    try:
        stamps = SlotStamps(host.num_blocks, plan.stamps_path(layout.rank) if host.shared_path else None)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    info = {"host": host.shared_path if stamps is not None and stamps.shared_path else None,
            "stamps": stamps.shared_path if stamps is not None else None}
    infos = comm.allgather(info, "remote tier (external): host tier files")
    tier = None
    if error is None:
        try:
            tier = _build(replicas, cfg, plan, infos, host, stamps, device, built,
                          RemoteRules.named(REMOTE_RULES if rules is None else rules))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    if not commit_or_undo(comm, error, built, stamps, host, layout.rank, "remote tier (external)"):
        return None
    return tier


def _build(replicas: ReplicaComms, cfg: CacheConfig, plan: SharePlan, infos: list[dict], host: HostPool,
           stamps: SlotStamps, device: torch.device, built: list, rules: RemoteRules) -> PeerTier:
    """Transports per peer replica: a copy out of the shared host tier of a peer on this
    node, MPI messages with every other; the landing area; the directory."""
    layout = replicas.layout
    rc = cfg.distributed.remote
    fail = faults.active("remote_fetch", layout.rank)
    rows = max(1, min(LANDING_BLOCKS, host.num_blocks))
    landing = torch.empty((rows, host.layout.bytes_per_block), dtype=torch.uint8,
                          pin_memory=device.type == "cuda")
    server = MessageServer(replicas.cross, host.raw, stamps, rules.check_stamps)
    built.append(server)
    tier_slots = _Rows()
    messages = MessageTransport(replicas.cross, landing, tier_slots, _NoWaits(), fail,
                                first_id=plan.token & ((1 << 48) - 1))
    copier = ImmediateCopier(_NoWaits())
    transports = {}
    here = plan.nodes[layout.rank]
    for peer in range(layout.num_replicas):
        if peer == layout.replica:
            continue
        theirs = layout.world_rank(peer, layout.tp_rank)
        info = infos[theirs]
        if rc.transport == "auto" and plan.nodes[theirs] == here and info["host"] and info["stamps"]:
            pool, peer_stamps = attach_peer_host(cfg, host, info, device, layout.rank, built)
            transports[peer] = SharedTransport(pool, peer_stamps, {HOST: landing}, copier, tier_slots,
                                               rules.check_stamps, fail)
        else:
            transports[peer] = messages
    channel = DirectoryChannel(replicas.cross, layout.replica, layout.num_replicas, plan.token)
    mine = infos[layout.rank]
    shared_here = rc.transport == "auto" and mine["host"] is not None and mine["stamps"] is not None
    serve = any(not (shared_here and plan.nodes[layout.world_rank(p, layout.tp_rank)] == here)
                for p in range(layout.num_replicas) if p != layout.replica)
    return PeerTier(tp=replicas.tp, replica=layout.replica, stamps=stamps, channel=channel,
                    directory=Directory(layout.num_replicas, layout.replica, host.num_blocks),
                    transports=transports, server=server, landing=landing,
                    fetch_timeout_s=rc.fetch_timeout_ms / 1000, every=rc.directory_every_steps,
                    host_slots=host.num_blocks, serve=serve)


class _Rows:
    """The landing area as the transports' landing slots: rows numbered from 0, no
    copies of the transfer engine to follow (``PeerTier.pending_events``)."""

    def tier_base(self, tier: int) -> int:
        return 0

    def pending_events(self, slots) -> list:
        return []
