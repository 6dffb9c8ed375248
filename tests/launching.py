"""Start ``python -m kvdist`` as a real job (alone, or several ranks through
launch/kvdist-launch) and act on it at a known moment: the helpers of the tests that
kill, interrupt or mis-configure a job."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, str(ROOT / "launch" / "kvdist-launch")]

TINY = {
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
    "cache": {"tokens_per_block": 16, "device": "cpu", "gpu": {"blocks": 64}, "host": {"bytes": "256KiB"}},
    "distributed": {"consensus_timeout_s": 20},
    "workload": {"requests": 20_000, "conversations": 8, "system_prompt_tokens": 64, "turns": [1, 4],
                 "user_tokens": [8, 32], "output_tokens": [2, 8], "arrival_rate": 2.0, "max_batch": 8,
                 "hidden": 16, "verify_logits_every": 0},
}


def launcher_module():
    """launch/kvdist-launch as a module (it is a script without a .py name)."""
    loader = importlib.machinery.SourceFileLoader("kvdist_launch", str(ROOT / "launch" / "kvdist-launch"))
    spec = importlib.util.spec_from_loader("kvdist_launch", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def tiny_config(tmp_path: Path, disk_dir: Path | None = None, **sections) -> Path:
    """A config that starts in a second and runs (far) longer than any test waits."""
    cfg = {k: dict(v) for k, v in TINY.items()}
    if disk_dir is not None:
        cfg["cache"]["disk"] = {"path": str(disk_dir), "bytes": "1MiB"}
    for name, over in sections.items():
        cfg.setdefault(name, {}).update(over)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(args: list[str], np: int | None = None, env: dict | None = None) -> subprocess.Popen:
    """``python -m kvdist ARGS`` alone (np None) or on ``np`` ranks, in its own process
    group (so a test can deliver a Ctrl-C to all of it), stdout and stderr piped."""
    cmd = [sys.executable, "-m", "kvdist", *args] if np is None else [*LAUNCH, "-n", str(np), *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPIEXEC_TIMEOUT": "120", **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float = 60) -> str:
    """Read the job's stdout until a line starting with ``prefix`` (the job's own
    progress is the clock: no sleeping)."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen = []
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith(prefix):
                return line
    kill_job(proc)
    raise AssertionError(f"no line starting {prefix!r}; stdout: {seen!r}; stderr: {proc.stderr.read()}")


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
    session of its own, out of reach of a process-group kill)."""
    kids, todo, tree = _children(), [proc.pid], []
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(kids.get(pid, []))
    for pid in tree:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
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
