"""Start ``python -m kvdist`` as a real job (alone, or several ranks through
launch/kvdist-launch) and act on it at a known moment: the helpers of the tests that
kill, interrupt or mis-configure a job."""

from __future__ import annotations

import contextlib
import os
import selectors
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from kvdist.launcher.leftovers import mapped_segments
from kvdist.launcher.rank_watcher import LEFTOVER_PREFIXES

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, str(ROOT / "launch" / "kvdist-launch")]
SHM = Path("/dev/shm")

TINY = {
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
    "cache": {"tokens_per_block": 16, "device": "cpu", "gpu": {"blocks": 64}, "host": {"bytes": "256KiB"}},
    "distributed": {"consensus_timeout_s": 20},
    "workload": {"requests": 20_000, "conversations": 8, "system_prompt_tokens": 64, "turns": [1, 4],
                 "user_tokens": [8, 32], "output_tokens": [2, 8], "arrival_rate": 2.0, "max_batch": 8,
                 "hidden": 16, "verify_logits_every": 0},
}


def run_mpi_tests(test_file: str, np: int = 4, env: dict | None = None) -> str:
    """Run the MPI tests of ``test_file`` as a job of their own under the mpiexec beside
    this Python (skip when there is none): the output, asserted to show every rank's
    ``1 passed``. What an aborted job leaves in /dev/shm (MPICH's segment) is removed."""
    import pytest

    from kvdist.launcher.leftovers import remove_leftovers, shm_segments

    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec beside this Python: `make venv` installs it")
    segments = shm_segments()
    r = subprocess.run([str(mpiexec), "-n", str(np), sys.executable, "-m", "mpi4py", "-m", "pytest", "-q",
                        "--with-mpi", "-p", "no:cacheprovider", test_file],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, encoding="utf-8",
                       env={**os.environ, "MPIEXEC_TIMEOUT": "120", **(env or {})})
    remove_leftovers(segments)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("1 passed") == np, out
    return out


def tiny_config(tmp_path: Path, disk_dir: Path | None = None, **sections) -> Path:
    """A config that starts in a second and runs (far) longer than any test waits; its
    trace (about 1 KB a request) fits the test bed's 32 MiB a rank, which the run checks."""
    cfg = {k: dict(v) for k, v in TINY.items()}
    if disk_dir is not None:
        cfg["cache"]["disk"] = {"path": str(disk_dir), "bytes": "1MiB"}
    for name, over in sections.items():
        cfg.setdefault(name, {}).update(over)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def start(args: list[str], np: int | None = None, env: dict | None = None) -> subprocess.Popen:
    """``python -m kvdist ARGS`` alone (np None) or on ``np`` ranks, in its own process
    group (so a test can deliver a Ctrl-C to all of it), stdout and stderr piped."""
    cmd = [sys.executable, "-m", "kvdist", *args] if np is None else [*LAUNCH, "-n", str(np), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPIEXEC_TIMEOUT": "120", **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, encoding="utf-8")


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60,
                  pids: Callable[[], list[int]] | None = None, cpu_s: float | None = None) -> str:
    """Read the job's stdout until a line starting with ``prefix``. The job's own
    progress is the clock, not the wall's: on a loaded machine a job's start can take
    minutes of wall time (under Open MPI a node's ranks share one scheduler group of
    the kernel's autogroup, so they get half the CPU of MPICH's, each in a session of
    its own). It fails when the job's processes (``pids()``, default: those under
    ``proc``) neither print nor use CPU for ``timeout`` s (a hang that sleeps), when
    they used ``cpu_s`` CPU-seconds without the line (a hang that spins, as a rank
    polling in a collective does; default ``2 * timeout``), or after ``10 * timeout`` s."""
    pids = pids or (lambda: descendants(proc.pid))
    cpu_s = 2 * timeout if cpu_s is None else cpu_s
    start = last_move = time.monotonic()
    cpu0 = last_cpu = cpu_seconds(pids())
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen: list[str] = []
    why = f"nothing printed and no CPU used for {timeout} s"
    while True:
        now = time.monotonic()
        used = cpu_seconds(pids())
        if used > last_cpu:
            last_cpu, last_move = used, now
        if now - last_move > timeout:
            break
        if used - cpu0 > cpu_s:
            why = f"{used - cpu0:.0f} CPU-seconds used without it"
            break
        if now - start > 10 * timeout:
            why = f"not within {10 * timeout} s"
            break
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if not line:
                why = "the job ended"
                break
            seen.append(line)
            last_move = time.monotonic()
            if line.startswith(prefix):
                return line
    kill_job(proc)
    raise AssertionError(f"no line starting {prefix!r} ({why}); stdout: {seen!r}; "
                         f"stderr: {proc.stderr.read()}")


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time the processes ``pids`` used (those still there)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """(exit status, rest of stdout, stderr) once the job ended by itself."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out, err = proc.communicate()
        raise AssertionError(f"the job did not end within {timeout} s; stderr: {err}") from None
    return proc.returncode, out, err


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the job and every process under it (mpiexec starts each rank in a
    session of its own, out of reach of a process-group kill), then remove the
    shared-memory files its processes mapped: MPICH unlinks its segment in an exit
    handler a killed rank never runs, and the launcher and the ranks' watchers, which
    clean up after killed ranks, are killed too."""
    pids = descendants(proc.pid)
    segments = shm_mapped_by(pids)  # this job's own, whatever else runs on the machine
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    if segments:
        _remove_when_unmapped(segments, pids)


def shm_mapped_by(pids: list[int]) -> set[Path]:
    """The files of /dev/shm named like MPICH's or kvdist's segments that ``pids`` map."""
    return {p for p in mapped_segments(SHM, Path("/proc"), pids) if p.name.startswith(LEFTOVER_PREFIXES)}


def _remove_when_unmapped(segments: set[Path], pids: list[int], timeout: float = 10.0) -> None:
    """Unlink ``segments`` once the killed ``pids`` are gone (a killed process maps its
    files until it has exited), those that no live process maps still."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in segments - mapped_segments(SHM, Path("/proc")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text(encoding="utf-8")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"PMI_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def rank_pid(proc: subprocess.Popen, rank: int) -> int:
    """The pid of the process that runs ``rank`` of the job under ``proc``."""
    kids = _children()
    todo = [proc.pid]
    while todo:
        pid = todo.pop(0)
        if _rank_of(pid) == rank:
            return pid
        todo.extend(kids.get(pid, []))
    raise AssertionError(f"no process of rank {rank} under pid {proc.pid}")


# -- a job in a mount namespace of its own -------------------------------------------------------
def private_unavailable() -> str | None:
    """Why a job cannot get a private /dev/shm and /tmp here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root for a mount namespace"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs kvprobe /tmp"], capture_output=True, text=True, encoding="utf-8")
    return None if probe.returncode == 0 else f"unshare -m failed: {probe.stderr.strip()}"


PRIVATE_DIR = "/tmp/job"  # the job's config and output, inside the namespace


def start_private(config: Path, args: list[str], np: int,
                  env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """``kvdist-launch -n NP ARGS`` (``{dir}`` in ARGS: the job's directory, holding
    ``config`` as tiny.yaml) in a mount namespace whose /dev/shm and /tmp are empty
    tmpfs of its own: what the job leaves there is its own, whatever else runs on the
    machine. Returns the launcher's process (the same pid as ``proc.pid``) and a holder
    process in the namespace (``private_files`` looks through it; kill it when done)."""
    argv = [a.replace("{dir}", PRIVATE_DIR) for a in args]
    # A checkout or interpreter under /tmp (a CI clone there) stays visible: opened before
    # the tmpfs hides it, bound back from that descriptor after.
    keep = _under_tmp()
    opened = "".join(f"exec {3 + i}<{shlex.quote(str(p))}; " for i, p in enumerate(keep))
    rebound = "".join(f"mkdir -p {q}; mount --no-canonicalize --bind /proc/self/fd/{3 + i} {q}; "
                      for i, q in enumerate(shlex.quote(str(p)) for p in keep))
    script = (f'set -e; {opened}mount -t tmpfs -o size=1g kvshm /dev/shm; mount -t tmpfs kvtmp /tmp; '
              f'{rebound}mkdir -p {PRIVATE_DIR}; cat > {PRIVATE_DIR}/tiny.yaml; '
              f'sleep 900 </dev/null >/dev/null 2>&1 & echo "holder $!"; '
              f'exec "$@"')
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *LAUNCH, "-n", str(np),
           *argv]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPIEXEC_TIMEOUT": "120", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, encoding="utf-8")
    proc.stdin.write(config.read_text(encoding="utf-8"))
    proc.stdin.close()
    holder = int(wait_for_line(proc, "holder ").split()[1])
    return proc, holder


def _under_tmp() -> list[Path]:
    """The checkout and the interpreter's folders that lie under /tmp (outermost only)."""
    tmp = Path("/tmp")
    paths = {p for p in (ROOT, Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent)
             if p != tmp and p.is_relative_to(tmp)}
    return sorted(p for p in paths if not any(q != p and p.is_relative_to(q) for q in paths))


def private_files(holder: int) -> list[str]:
    """What is in the namespace's /dev/shm and /tmp, but the job's own directory (and
    the checkout or interpreter bound back there)."""
    root = Path(f"/proc/{holder}/root")
    mine = {PRIVATE_DIR} | {f"/tmp/{p.relative_to('/tmp').parts[0]}" for p in _under_tmp()}
    shm = [f"/dev/shm/{p.name}" for p in (root / "dev" / "shm").iterdir()]
    tmp = [f"/tmp/{p.name}" for p in (root / "tmp").iterdir() if f"/tmp/{p.name}" not in mine]
    return sorted(shm + tmp)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it now."""
    kids, todo, tree = _children(), [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(kids.get(p, []))
    return tree


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (not gone, not zombies)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out
