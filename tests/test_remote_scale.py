"""``bench remote --at-scale``: the directory's memory and messages on paper are the
sizes the code builds (a small deployment, built for real, against the same function)."""

from __future__ import annotations

import numpy as np

from kvdist.bench.remote_scale import Deployment, upkeep_on_paper
from kvdist.distributed.directory import Directory, encode
from kvdist.distributed.node_directory import NodeShape
from kvdist.distributed.stamps import SlotStamps


def test_a_mirrors_size_on_paper_is_the_size_of_the_one_built():
    for peers, slots in [(1, 1), (1, 64), (3, 100), (7, 1000), (2, 4097)]:
        built = Directory(peers + 1, 0, slots)
        assert Directory.sized(peers, slots) == built.nbytes, (peers, slots)
    part = Directory(6, 2, 50, mirrored=(0, 5))  # node peers 1, 3, 4 are not mirrored
    assert Directory.sized(2, 50) == part.nbytes


def test_the_paper_rows_are_what_the_code_builds_and_sends():
    d = Deployment(replicas=6, tp=2, nodes=3, host_slots=40, changes=3, every=4)
    rows = {what: (built, messages) for what, built, messages in upkeep_on_paper(d)}

    def mib(n: int) -> str:
        return f"{n / 2**20:,.2f} MiB"

    # Replica 0 of a node of replicas 0 and 1: it mirrors replicas 2..5, and with no
    # node directory it would mirror 1..5.
    mirror = Directory(6, 0, 40, mirrored=(2, 3, 4, 5)).nbytes
    everyone = Directory(6, 0, 40).nbytes
    stamps = SlotStamps(40).arr.nbytes
    node_file = NodeShape((0, 1), 2, 40).nbytes
    assert rows["message peers a rank (same TP index of each)"] == ("4", "5")
    assert rows["memory a rank: mirror of the message peers' host tiers"] == (mib(mirror), mib(everyone))
    assert rows["memory a node: node directory file in /dev/shm"] == (mib(node_file), mib(0))
    assert rows["memory a node: all of it (4 ranks)"] == (mib(4 * (mirror + stamps) + node_file),
                                                          mib(4 * (everyone + stamps)))
    # One message: the channel's header row and one record per slot changed since the
    # last message (3 a step x 4 steps), as DirectoryChannel._post sends it.
    records = encode(np.arange(12), np.ones(12, dtype=bool), np.arange(12, dtype=np.uint64),
                     np.arange(12, dtype=np.uint64))
    message = np.concatenate((np.zeros((1, 3), dtype=np.uint64), records)).nbytes
    assert rows["bytes a rank sends a step (12 records a message)"] == (f"{4 * message / 4:,.0f}",
                                                                         f"{5 * message / 4:,.0f}")
    assert rows["messages leaving a node a step"] == (f"{4 * 4 / 4:,.0f}", f"{4 * 4 / 4:,.0f}")
    assert rows["messages inside a node a step"] == ("0", f"{4 * 1 / 4:,.0f}")
