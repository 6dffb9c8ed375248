"""launch/kvdist-launch: the mpiexec command it builds for MPICH and Open MPI, how it
finds mpiexec and sets MPIEXEC_TIMEOUT, and — launched for real — each rank's GPU
choice from its node-local rank under faked node layouts."""

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "kvdist-launch"


def fake_mpiexec(tmp_path: Path, version: str) -> Path:
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{version}'\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(autouse=True)
def launcher_env(monkeypatch):
    """The launcher reads these; the caller's values (a GPU box exports MPIEXEC) must not
    change what a test sees."""
    for name in ("MPIEXEC", "MPIEXEC_TIMEOUT", "MPI4PY_LIBMPI", "KVDIST_PYTHON"):
        monkeypatch.delenv(name, raising=False)


def launch(*argv: str, env: dict | None = None, timeout: int = 60,
           script: Path = LAUNCH) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=ROOT, encoding="utf-8")


def dry_run(*argv: str, env: dict | None = None, script: Path = LAUNCH) -> tuple[dict, list[str]]:
    """The environment assignments and the command line the launcher would run."""
    out = launch("--dry-run", *argv, env=env, script=script)
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout.strip())
    assignments = {}
    while words and "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        assignments[name] = value
    return assignments, words


def test_mpich_command_line(tmp_path):
    mpiexec = fake_mpiexec(tmp_path, "HYDRA build details: Version: 4.2.0")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a\nnode-b\n", encoding="utf-8")
    env, cmd = dry_run("-n", "8", "--hostfile", str(hosts), "--ppn", "4", "--mpiexec", str(mpiexec),
                       "--python", sys.executable, "run", "--config", "configs/default.yaml")
    assert cmd == [str(mpiexec), "-n", "8", "-f", str(hosts), "-ppn", "4", sys.executable, "-m", "mpi4py",
                   "-m", "kvdist", "run", "--config", "configs/default.yaml"]
    assert env["MPIEXEC_TIMEOUT"] == "3600"


def test_open_mpi_command_line_forwards_kvdist_environment(tmp_path):
    mpiexec = fake_mpiexec(tmp_path, "mpirun (Open MPI) 4.1.5")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=4\n", encoding="utf-8")
    env, cmd = dry_run("-n", "4", "--hostfile", str(hosts), "--ppn", "2", "--python", sys.executable,
                       "--", "placement", env={"MPIEXEC": str(mpiexec), "KVDIST_FAULTS": "stall@1",
                                               "MPIEXEC_TIMEOUT": "90"})
    assert cmd[:4] == [str(mpiexec), "-n", "4", "--oversubscribe"]
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert cmd[cmd.index("--hostfile") + 1] == str(hosts)
    assert cmd[cmd.index("--map-by") + 1] == "ppr:2:node"
    exported = {cmd[i + 1] for i, w in enumerate(cmd) if w == "-x"}
    assert {"KVDIST_FAULTS", "PYTHONUNBUFFERED"} <= exported and "HOME" not in exported
    assert cmd[-6:] == [sys.executable, "-m", "mpi4py", "-m", "kvdist", "placement"]
    assert env["MPIEXEC_TIMEOUT"] == "90"  # the environment's wins over the default


def test_finds_the_venv_mpiexec_and_rejects_a_wrong_one(tmp_path):
    # A checkout of its own (the launcher and a .venv with an mpiexec), whatever this
    # machine's repository and environment hold.
    (tmp_path / "launch").mkdir()
    script = Path(shutil.copy(LAUNCH, tmp_path / "launch" / "kvdist-launch"))
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    venv_mpiexec = fake_mpiexec(tmp_path / ".venv" / "bin", "HYDRA build details: Version: 4.2.0")
    env, cmd = dry_run("--timeout", "0", "bench", "manager", script=script)
    assert cmd[0] == str(venv_mpiexec) and "MPIEXEC_TIMEOUT" not in env
    assert cmd[-3:] == ["kvdist", "bench", "manager"]
    out = launch("run", "--config", "x", env={"MPIEXEC": str(tmp_path / "missing")})
    assert out.returncode == 127 and "is not an executable" in out.stderr
    out = launch("-n", "2")
    assert out.returncode == 2 and "give a kvdist command" in out.stderr


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "mpiexec").exists(), reason="needs the venv's MPICH")
@pytest.mark.parametrize("per_node,gpus,expected", [
    # (node, local rank, device) of ranks 0..3; the global rank would pick other GPUs
    (2, 4, [(0, 0, "cuda:0"), (0, 1, "cuda:1"), (1, 0, "cuda:0"), (1, 1, "cuda:1")]),
    (3, 2, [(0, 0, "cuda:0"), (0, 1, "cuda:1"), (0, 2, "cuda:0"), (1, 0, "cuda:0")]),
])
def test_ranks_pick_their_gpu_by_node_local_rank(per_node, gpus, expected):
    """A real 4-rank launch with the node layout faked: device = cuda:<local rank mod GPUs>."""
    out = launch("-n", "4", "placement", "--gpus-per-node", str(gpus),
                 env={"KVDIST_FAKE_RANKS_PER_NODE": str(per_node)}, timeout=180)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    got = [(int(r[2]), int(r[3].split("/")[0]), r[4]) for r in rows if len(r) == 5 and r[2].isdigit()]
    assert got == expected, out.stdout
    assert f"4 ranks on {len({n for n, _, _ in expected})} node(s)" in out.stdout


def test_ranks_load_the_mpi_of_their_mpiexec(tmp_path):
    """An mpiexec with its own libmpi (``<prefix>/lib``) makes the ranks' mpi4py load it;
    an MPI4PY_LIBMPI of the environment wins."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    mpirun = fake_mpiexec(tmp_path / "bin", "mpirun (Open MPI) 5.0.11")
    libmpi = tmp_path / "lib" / "libmpi.so.40"
    libmpi.touch()
    env, cmd = dry_run("-n", "2", "--mpiexec", str(mpirun), "--python", sys.executable, "placement")
    assert env["MPI4PY_LIBMPI"] == str(libmpi)
    assert cmd[cmd.index("MPI4PY_LIBMPI") - 1] == "-x"
    env, _ = dry_run("-n", "2", "--mpiexec", str(mpirun), "placement", env={"MPI4PY_LIBMPI": "/x/libmpi.so"})
    assert env["MPI4PY_LIBMPI"] == "/x/libmpi.so"
    libmpi.unlink()
    env, _ = dry_run("-n", "2", "--mpiexec", str(mpirun), "placement")
    assert "MPI4PY_LIBMPI" not in env


def test_module_runs_another_python_module(tmp_path):
    mpiexec = fake_mpiexec(tmp_path, "HYDRA build details: Version: 4.2.0")
    _, cmd = dry_run("-n", "4", "--mpiexec", str(mpiexec), "--python", sys.executable,
                     "--module", "pytest", "--", "-q", "tests/mpi")
    assert cmd[-7:] == [sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "tests/mpi"]
    _, cmd = dry_run("-n", "4", "--mpiexec", str(mpiexec), "--module", "myengine.serve")
    assert cmd[-2:] == ["-m", "myengine.serve"]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(),
                    reason="needs the checkout's venv (make venv)")
def test_the_launcher_runs_from_a_python_without_kvdists_dependencies():
    """`launch/kvdist-launch` as the README shows it, from a shell whose python3 is not the
    venv's (kvdist's imports, xxhash among them, are only in the venv): it re-executes
    with the checkout's venv instead of failing with a traceback."""
    base = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if base is None or Path(base).resolve() == Path(sys.executable).resolve():
        pytest.skip("no python3 other than the venv's")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}
    out = subprocess.run([base, str(LAUNCH), "--dry-run", "-n", "2", "placement"], capture_output=True,
                         text=True, timeout=60, env=env, encoding="utf-8")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert str(ROOT / ".venv" / "bin" / "python") in out.stdout and "-m kvdist placement" in out.stdout
