"""Which mpiexec and which Python a job runs with, and the mpiexec command line for
MPICH's Hydra (and look-alikes) and Open MPI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["FORWARD_PREFIXES", "REPO", "build_command", "find_mpiexec", "find_python", "flavor",
           "libmpi_of"]

REPO = Path(__file__).resolve().parents[2]  # the checkout (its .venv), when kvdist runs from one
# Open MPI forwards only what -x names; MPICH's Hydra forwards the whole environment.
FORWARD_PREFIXES = ("KVDIST_", "MPI4PY_", "PYTHON", "CUDA_", "NCCL_", "OMP_", "LD_LIBRARY_PATH", "PATH")


def _executable(path: str | None) -> str | None:
    return path if path and os.access(path, os.X_OK) and not os.path.isdir(path) else None


def find_python(explicit: str | None, repo: Path = REPO) -> str | None:
    """The interpreter for the ranks: ``explicit`` (--python; None if it is no
    executable), else $KVDIST_PYTHON, the repo's venv, this one."""
    if explicit:
        return _executable(explicit if os.sep in explicit else shutil.which(explicit))
    for cand in (os.environ.get("KVDIST_PYTHON"), str(repo / ".venv" / "bin" / "python")):
        path = _executable(shutil.which(cand) if cand and os.sep not in cand else cand)
        if path:
            return path
    return sys.executable


def find_mpiexec(explicit: str | None, python: str, repo: Path = REPO) -> str | None:
    """--mpiexec or $MPIEXEC (which must work), else the repo's venv, the one next to
    ``python``, then PATH."""
    for given in (explicit, os.environ.get("MPIEXEC")):
        if given:
            return _executable(given if os.sep in given else shutil.which(given))
    for cand in (str(repo / ".venv" / "bin" / "mpiexec"), str(Path(python).parent / "mpiexec"),
                 shutil.which("mpiexec"), shutil.which("mpirun")):
        if _executable(cand):
            return cand
    return None


def flavor(mpiexec: str) -> str:
    """``openmpi``, ``mpich`` (Hydra, also Intel MPI) or ``unknown``, from ``--version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20,
            encoding="utf-8")
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def build_command(np: int, hostfile: str | None, ppn: int | None, module: str, command: list[str],
                  mpiexec: str, kind: str, python: str, env: dict[str, str]) -> list[str]:
    """The mpiexec command line: ``np`` ranks of ``python -m mpi4py -m MODULE COMMAND``.
    Values of the environment never appear on it (Open MPI's ``-x`` names them)."""
    cmd = [mpiexec, "-n", str(np)]
    if kind == "openmpi":
        cmd.append("--oversubscribe")  # more ranks than cores is fine for CPU runs and tests
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if hostfile:
            cmd += ["--hostfile", hostfile]
        if ppn:
            cmd += ["--map-by", f"ppr:{ppn}:node"]
        for name in sorted(env):
            if name.startswith(FORWARD_PREFIXES):
                cmd += ["-x", name]
    else:  # MPICH's Hydra (and look-alikes) take -f and -ppn, and forward the environment
        if hostfile:
            cmd += ["-f", hostfile]
        if ppn:
            cmd += ["-ppn", str(ppn)]
    return cmd + [python, "-m", "mpi4py", "-m", module, *command]


def libmpi_of(mpiexec: str, kind: str) -> str | None:
    """The MPI library installed with ``mpiexec`` (``<prefix>/lib``), if there is one:
    the ranks must load it, not another MPI that mpi4py might find first."""
    name = {"openmpi": "libmpi.so.40", "mpich": "libmpi.so.12"}.get(kind)
    if name is None:
        return None
    path = Path(os.path.realpath(mpiexec)).parent.parent / "lib" / name
    return str(path) if path.exists() else None
