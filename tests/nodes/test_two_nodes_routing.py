"""The prefix-aware router on the two-node bed (``testbed.py``), under MPICH and Open
MPI: 2 nodes x 2 ranks = 2 replicas x TP 2, one per node, the router on node a. The
checks of ``ranks_routing.py``: the far replica's KV events cross the veth pair and
rebuild its tiers exactly; a request goes to the far replica holding its longest prefix
and its finish comes back; ``run --compare`` of prefix-aware replicas across the nodes;
replicas spanning nodes on loopback endpoints are refused with one line."""

from __future__ import annotations

import re
from pathlib import Path

from tests.nodes import jobs
from tests.nodes.test_two_nodes import FLAVORS, launch, scratch_left

RANKS = Path(__file__).with_name("ranks_routing.py")


@FLAVORS
def test_routing_across_two_nodes(bed, flavor):
    """Every check of ranks_routing.py passes on all four ranks; no disk file is left."""
    out = launch(bed, flavor, "--module", "pytest", "--", "-q", "--color=no", "-p", "no:cacheprovider",
                 "--with-mpi", str(RANKS.relative_to(jobs.ROOT)))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    tests = len(re.findall(r"^def test_", RANKS.read_text(), flags=re.MULTILINE))
    passed = re.findall(r"(\d+) passed(?:, \d+ warnings?)? in", out.stdout)  # a rank may warn
    assert passed == [str(tests)] * 4, out.stdout[-3000:]
    assert scratch_left(bed) == {n.name: [] for n in bed.nodes}
