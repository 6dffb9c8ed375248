"""Where each rank runs: node, node-local rank and the GPU it picks.

The node layout comes from ``Split_type(COMM_TYPE_SHARED)`` (through
:func:`kvdist.distributed.comm.resolve`, which honours ``KVDIST_FAKE_RANKS_PER_NODE``), and
the device from :func:`kvdist.select_device` — ``cuda:<node-local rank mod GPUs>`` —
exactly what ``kvdist.create`` uses, so an engine that picks its GPU the same way
lands on the same device as its cache.

``python -m kvdist placement`` prints the table for a job (``launch/kvdist-launch -n 8
--hostfile H placement``); ``--gpus-per-node N`` shows what the ranks would pick on
nodes with N GPUs, e.g. from a login node without any."""

from __future__ import annotations

import argparse
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from tabulate import tabulate

from ...candidate import select_device
from ...distributed.comm import resolve


@dataclass(frozen=True, slots=True)
class Placement:
    rank: int
    host: str
    node: int
    local_rank: int
    local_size: int
    device: str


@contextlib.contextmanager
def assume_gpus(count: int | None) -> Iterator[None]:
    """Make this process see ``count`` CUDA devices for device *selection* only (no
    CUDA call is made); ``None`` leaves the real ones."""
    if count is None:
        yield
        return
    with mock.patch.object(torch.cuda, "is_available", lambda: count > 0), \
            mock.patch.object(torch.cuda, "device_count", lambda: count):
        yield


def placements(device: str = "auto", comm=None, gpus_per_node: int | None = None
               ) -> tuple[int, list[Placement]]:
    """This rank's number and every rank's placement (collective over ``comm``,
    COMM_WORLD when None and MPI runs)."""
    c = resolve(comm)
    try:
        with assume_gpus(gpus_per_node):
            dev = select_device(device, c.node.local_rank)
        mine = (socket.gethostname(), c.node.node, c.node.local_rank, c.node.local_size, str(dev))
        everyone = c.allgather(mine, "placement")
        return c.rank, [Placement(r, *p) for r, p in enumerate(everyone)]
    finally:
        c.free()


def render(table: list[Placement]) -> str:
    rows = [[p.rank, p.host, p.node, f"{p.local_rank}/{p.local_size}", p.device] for p in table]
    nodes = len({p.node for p in table})
    return (f"{len(table)} ranks on {nodes} node(s)\n"
            + tabulate(rows, headers=["rank", "host", "node", "local rank", "device"]))


def main(args: argparse.Namespace) -> int:
    """``python -m kvdist placement [--device SPEC] [--gpus-per-node N]`` (on every rank)."""
    rank, table = placements(args.device, gpus_per_node=args.gpus_per_node)
    if rank == 0:
        print(render(table), flush=True)
    return 0
