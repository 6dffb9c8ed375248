"""``python -m kvdist bench remote --at-scale R,T,N``: what keeping the remote tier's
directory costs on paper for R replicas of T TP ranks over N nodes — memory and
messages per step — computed from the sizes the code uses (no ranks needed).

The replicas on one node are node peers (``remote_setup``): they list their blocks in
one node directory file in /dev/shm (``NodeShape``) and send each other nothing; every
other replica is a message peer, mirrored by each rank (``Directory.sized``) and sent
one message of 24-byte records (``directory.RECORD_WORDS``) every ``every`` steps
(``distributed.remote.directory_every_steps``), carrying the host slots changed since
the last one, each once. The column "messages only" is the same job with no node
directory (every other replica a message peer), as with ``transport: messages``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..distributed.directory import RECORD_WORDS, Directory
from ..distributed.node_directory import NodeShape
from ..distributed.stamps import SlotStamps

__all__ = ["Deployment", "report", "upkeep_on_paper"]

WORD = np.dtype(np.uint64).itemsize


@dataclass(frozen=True, slots=True)
class Deployment:
    replicas: int = 64
    tp: int = 8
    nodes: int = 8
    # Host-tier slots a rank: configs/h200.yaml's 24 GiB of 2 MiB blocks.
    host_slots: int = 12_288
    # Host slots whose block changes a step on a rank (offloads, demotions, landings):
    # 44 in ``bench remote --upkeep`` (2 admissions a step, decoded 4 steps each).
    changes: int = 44
    every: int = 8  # directory_every_steps, the config's default

    @property
    def per_node(self) -> int:
        """Replicas whole on each node."""
        assert self.replicas % self.nodes == 0, \
            f"{self.replicas} replicas do not fill {self.nodes} nodes alike"
        return self.replicas // self.nodes


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def upkeep_on_paper(d: Deployment) -> list[tuple[str, str, str]]:
    """Rows (what, with the node directory, messages only) per rank or per node, and per
    step where it is traffic."""
    ranks_per_node = d.per_node * d.tp
    H = d.host_slots
    stamps = SlotStamps(H).arr.nbytes
    node_file = NodeShape(tuple(range(d.per_node)), d.tp, H).nbytes if d.per_node > 1 else 0
    records = min(d.changes * d.every, H)  # a message's records: slots changed since the last, once each
    message = (1 + records) * RECORD_WORDS * WORD  # a header row, then the records
    out = []

    def row(what: str, built: float, messages_only: float, fmt) -> None:
        out.append((what, fmt(built), fmt(messages_only)))

    peers = {"built": d.replicas - d.per_node, "messages": d.replicas - 1}  # message peers a rank
    mirror = {k: Directory.sized(p, H) for k, p in peers.items()}
    row("message peers a rank (same TP index of each)", peers["built"], peers["messages"], lambda v: f"{v:,}")
    row("node peers a replica (node directory, no messages)", d.per_node - 1, 0, lambda v: f"{v:,}")
    row("memory a rank: mirror of the message peers' host tiers", mirror["built"], mirror["messages"], _mib)
    row("memory a rank: its stamps (24 B a host slot)", stamps, stamps, _mib)
    row("memory a node: node directory file in /dev/shm", node_file, 0, _mib)
    row(f"memory a node: all of it ({ranks_per_node} ranks)",
        ranks_per_node * (mirror["built"] + stamps) + node_file,
        ranks_per_node * (mirror["messages"] + stamps), _mib)
    row("directory messages a rank sends a step", peers["built"] / d.every, peers["messages"] / d.every,
        lambda v: f"{v:,.2f}")
    row(f"bytes a rank sends a step ({records:,} records a message)",
        peers["built"] * message / d.every, peers["messages"] * message / d.every, lambda v: f"{v:,.0f}")
    row("records a rank applies a step", peers["built"] * records / d.every,
        peers["messages"] * records / d.every, lambda v: f"{v:,.0f}")
    node_msgs = {k: ranks_per_node * p / d.every for k, p in peers.items()}
    inside = {"built": 0, "messages": ranks_per_node * (d.per_node - 1) / d.every}
    row("messages leaving a node a step", node_msgs["built"] - inside["built"],
        node_msgs["messages"] - inside["messages"], lambda v: f"{v:,.0f}")
    row("messages inside a node a step", inside["built"], inside["messages"], lambda v: f"{v:,.0f}")
    row("bytes leaving a node a step", (node_msgs["built"] - inside["built"]) * message,
        (node_msgs["messages"] - inside["messages"]) * message, _mib)
    agree = d.replicas * WORD  # one count per replica (and 3 per block in flight)
    row("TP group's agreement, bytes a boundary (+24 a block in flight)", agree, agree,
        lambda v: f"{v:,.0f}")
    return out


def report(d: Deployment) -> str:
    from tabulate import tabulate

    head = (f"bench remote --at-scale: {d.replicas} replicas x TP {d.tp} over {d.nodes} nodes "
            f"({d.per_node} replicas, {d.per_node * d.tp} ranks a node), host tiers of {d.host_slots:,} "
            f"slots a rank, {d.changes} host-slot changes a step a rank, directory messages every "
            f"{d.every} steps; on paper, from the sizes the code uses")
    return head + "\n" + tabulate(upkeep_on_paper(d), headers=["", "node directory (built)", "messages only"],
                                  tablefmt="simple")
