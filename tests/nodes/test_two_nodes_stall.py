"""A rank stopped mid-run on the two-node bed (2 nodes x 2 ranks, launched from node a;
a rank on node b under MPICH, one on node a under Open MPI): every other rank, on
either node, names it — world rank, node, pid, the collective — within
``distributed.step_timeout_s`` + 2 s, the job ends by itself with status 3, and no node
keeps a file in its /dev/shm or its scratch disk."""

from __future__ import annotations

import os
import re
import selectors
import signal
import time

import pytest

from tests.launching import tiny_config, wait_for_line
from tests.nodes import jobs, testbed
from tests.nodes.test_two_nodes import WHERE, rank_process, scratch_left

STEP_TIMEOUT_S = 3.0
NAMED = re.compile(r"kvdist: rank (\d+) \(node (\S+), pid (\d+)\) has not reached .+ for \d+ s "
                   r"\(stopped\? SIGSTOP, a debugger, swapping\); seen by rank (\d+) .*; rank (\d+) closed "
                   r"its cache, the job ends")


def shm_of(bed, node) -> list[str]:
    out = bed.run(node, ["ls", "-A", "/dev/shm"], timeout=30)
    assert out.returncode == 0, out.stderr
    return sorted(out.stdout.split())


@WHERE
def test_a_stopped_rank_is_named_on_both_nodes_and_the_job_ends(bed, flavor, rank, tmp_path):
    if not jobs.MPIEXEC[flavor].exists():
        pytest.skip(f"no {jobs.MPIEXEC[flavor].relative_to(jobs.ROOT)}: `make venv` installs it")
    before = {n.name: shm_of(bed, n) for n in bed.nodes}
    cfg = tiny_config(tmp_path, disk_dir=bed.scratch,
                      distributed={"consensus_timeout_s": 30, "step_timeout_s": STEP_TIMEOUT_S},
                      workload={"requests": 5000})  # the bed's nodes have 32 MiB a rank for the trace
    proc = jobs.start(bed, flavor, "run", "--config", str(cfg), "--quiet", "--out", str(tmp_path / "runs"),
                      timeout=120)
    named: list[tuple[float, str]] = []
    try:
        wait_for_line(proc, "kvdist run: 4 ranks")
        time.sleep(1.5)  # every rank past its first step (until then the start-up's bound)
        node = bed.nodes[rank // 2].name
        victim = rank_process(node, rank)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)
        rest = []
        end = stopped + 60
        while time.monotonic() < end and sel.select(timeout=max(0.0, end - time.monotonic())):
            line = proc.stderr.readline()
            if not line:
                break
            clean = line.replace("\0", "").strip()
            (named if NAMED.search(clean) else rest).append((time.monotonic(), clean))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            testbed.kill_session(proc)
    lines = [ln for _, ln in named]
    said = "\n".join(lines + [ln for _, ln in rest])
    assert proc.returncode == 3, said
    # Every other rank, on both nodes. Open MPI ends the job with SIGCONT before its
    # SIGTERM: the stopped rank then runs, learns the verdict and says it too.
    said_by = {int(NAMED.search(ln).group(5)) for ln in lines}
    assert sorted(said_by - {rank}) == [r for r in range(4) if r != rank], said
    for ln in lines:
        m = NAMED.search(ln)
        assert (int(m.group(1)), m.group(2), int(m.group(3))) == (rank, node, victim), said
    late = [round(t - stopped, 2) for t, ln in named if int(NAMED.search(ln).group(5)) != rank]
    print(f"{flavor}: named {late} s after SIGSTOP of rank {rank}")
    assert max(late) <= STEP_TIMEOUT_S + 2.0, late
    assert "Traceback" not in said
    assert scratch_left(bed) == {n.name: [] for n in bed.nodes}
    assert {n.name: shm_of(bed, n) for n in bed.nodes} == before
