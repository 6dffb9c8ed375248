"""The prefix-aware router on the two-node bed (``testbed.py``), under MPICH (the events
and the router's messages are ZMQ, not MPI: Open MPI's launch on the bed is
test_two_nodes.py's): 2 nodes x 2 ranks = 2 replicas x TP 2, one per node, the router on node a. The
checks of ``ranks_routing.py``: the far replica's KV events cross the veth pair and
rebuild its tiers exactly; a request goes to the far replica holding its longest prefix
and its finish comes back; ``run --compare`` of prefix-aware replicas across the nodes;
replicas spanning nodes on loopback endpoints are refused with one line."""

from __future__ import annotations

from pathlib import Path

from tests.nodes.test_two_nodes import every_check_passes

RANKS = Path(__file__).with_name("ranks_routing.py")


def test_routing_across_two_nodes(bed):
    """Every check of ranks_routing.py passes on all four ranks; no disk file is left."""
    every_check_passes(bed, "mpich", RANKS)
