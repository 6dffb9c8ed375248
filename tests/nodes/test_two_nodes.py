"""kvdist on two nodes for real (the test bed of ``testbed.py``), under MPICH and Open
MPI, started with ``launch/kvdist-launch --hostfile``: 2 nodes x 2 ranks run the checks
of ``ranks_two_nodes.py`` — host names and the node split, node-private memory and
disks, MPI traffic over the network, the consensus drills with faults on either node,
``host: auto`` per node, a short main job with tensor parallelism 4 across both, and 2
replicas x TP 2 (one per node) fetching each other's blocks through the remote tier; a
rank SIGKILLed on either node is named by the launcher on node a."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launching import tiny_config, wait_for_line
from tests.nodes import jobs, testbed
from tests.nodes.testbed import TwoNodes

RANKS = Path(__file__).with_name("ranks_two_nodes.py")
FLAVORS = pytest.mark.parametrize("flavor", sorted(jobs.MPIEXEC))
# A rank on either node, each under one flavor (every pairing would double the bed's time,
# the suite's longest; both flavors launch on both nodes in test_ranks_on_two_nodes).
WHERE = pytest.mark.parametrize("flavor,rank", [("mpich", 3), ("openmpi", 1)],
                                ids=["on-node-b-mpich", "on-node-a-openmpi"])


def launch(bed: TwoNodes, flavor: str, *argv: str) -> subprocess.CompletedProcess:
    """``argv`` on 2 nodes x 2 ranks under ``flavor``, telling the ranks about the bed."""
    mpiexec = jobs.MPIEXEC[flavor]
    if not mpiexec.exists():
        pytest.skip(f"no {mpiexec.relative_to(jobs.ROOT)}: `make venv` installs MPICH and Open MPI there")
    return jobs.launch(bed, flavor, *argv, env=bed.env())


def scratch_left(bed: TwoNodes) -> dict[str, list[str]]:
    return {n.name: sorted(p.name for p in n.scratch.iterdir()) for n in bed.nodes}


def test_nodes_are_two_isolated_hosts(bed):
    """Each node: its host name, loopback and its end of the /30, and no other route;
    the machine's own namespace has neither the veth pair nor the /30."""
    net = ipaddress.ip_network(f"{bed.nodes[0].address}/30", strict=False)
    for node in bed.nodes:
        out = bed.run(node, ["sh", "-c", "hostname; ip -o addr; echo routes; ip route; ip -6 route"],
                      timeout=30)
        assert out.returncode == 0, out.stderr
        host, rest = out.stdout.split("\n", 1)
        addrs, routes = rest.split("routes\n")
        assert host == node.name
        got = sorted(re.findall(r"^\d+: (\S+)\s+(inet6?) (\S+)", addrs, flags=re.MULTILINE))
        assert got == sorted([("lo", "inet", "127.0.0.1/8"), ("lo", "inet6", "::1/128"),
                              (node.name, "inet", f"{node.address}/30")]), addrs
        assert routes.split("\n")[0].split()[:3] == [str(net), "dev", node.name], routes
        assert [r for r in routes.splitlines()[1:] if r and not r.startswith("::1 ")] == [], routes
    here = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True,
        encoding="utf-8").stdout
    assert str(net.network_address)[:-1] not in here and bed.nodes[0].name not in here


@FLAVORS
def test_ranks_on_two_nodes(bed, flavor):
    """Every check of ranks_two_nodes.py passes on all four ranks (none skips); no disk
    file is left on either node."""
    every_check_passes(bed, flavor, RANKS)


def every_check_passes(bed: TwoNodes, flavor: str, ranks: Path) -> None:
    """Run the checks of ``ranks`` with pytest on the bed's 4 ranks: every one passes on
    every rank, and no disk file is left on either node."""
    out = launch(bed, flavor, "--module", "pytest", "--", "-q", "--color=no", "-p", "no:cacheprovider",
                 "--with-mpi", str(ranks.relative_to(jobs.ROOT)))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    tests = len(re.findall(r"^def test_", ranks.read_text(encoding="utf-8"), flags=re.MULTILINE))
    passed = re.findall(r"(\d+) passed(?:, \d+ warnings?)? in", out.stdout)  # a rank may warn
    assert passed == [str(tests)] * 4, out.stdout[-3000:]
    assert scratch_left(bed) == {n.name: [] for n in bed.nodes}


def rank_process(node: str, rank: int) -> int:
    """The pid of the process that runs ``rank`` (of MPI_COMM_WORLD) inside ``node``."""
    for pid in testbed.pids_in(node):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = {f"PMI_RANK={rank}".encode(), f"PMIX_RANK={rank}".encode()}
        if b"mpi4py" in cmdline and ranks & set(environ):
            return pid
    raise AssertionError(f"no process of rank {rank} in {node}")


def bed_pids(bed: TwoNodes) -> list[int]:
    return [pid for node in bed.nodes for pid in testbed.pids_in(node.name)]


@WHERE
def test_a_killed_rank_is_named_on_any_node(bed, flavor, rank, tmp_path):
    """SIGKILL of one rank of a running job (2 nodes x 2 ranks, launched from node a):
    the job ends within seconds and the launcher's one line names that rank, its pid,
    its node and the signal, whichever node it ran on (mpiexec's own banner names a pid
    only (MPICH) or, under Open MPI, at times a survivor that aborted first)."""
    if not jobs.MPIEXEC[flavor].exists():
        pytest.skip(f"no {jobs.MPIEXEC[flavor].relative_to(jobs.ROOT)}: `make venv` installs it")
    cfg = tiny_config(tmp_path)
    proc = jobs.start(bed, flavor, "run", "--config", str(cfg), "--quiet", "--out", str(tmp_path / "runs"),
                      timeout=630)
    try:  # the CPU of the bed's processes is the clock of the job's start (slow on a loaded machine)
        wait_for_line(proc, "kvdist run: 4 ranks", pids=lambda: bed_pids(bed))
        node = bed.nodes[rank // 2].name
        victim = rank_process(node, rank)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            testbed.kill_session(proc)
    assert proc.returncode != 0, err[-3000:]
    said = [ln.replace("\0", "").strip() for ln in err.splitlines() if "kvdist: rank" in ln]
    assert said == [f"kvdist: rank {rank} (pid {victim} on {node}) was killed by SIGKILL; the job ends"], \
        out[-2000:] + err[-4000:]
    assert took < 10, f"the job took {took:.1f} s to end"
