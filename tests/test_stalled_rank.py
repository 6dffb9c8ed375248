"""No silent hang: a rank that stops mid-run (SIGSTOP: as a debugger or swapping would)
is named by every other rank within ``distributed.step_timeout_s`` + 2 s — its world
rank, node and pid, and the collective it did not reach — and the job ends by itself
with exit status 3, leaving nothing in /dev/shm or the disk tier. And a SIGTERM to any
rank of a job of replicas stops every rank of every replica at once: exit 143, the
world rank named, no traceback. Real jobs through launch/kvdist-launch."""

import os
import re
import selectors
import signal
import time
from pathlib import Path

import pytest

from .launching import finish, kill_job, rank_pid, start, tiny_config, wait_for_line

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find the ranks")

STEP_TIMEOUT_S = 3.0
NAMED = re.compile(r"^kvdist: rank (\d+) \(node (\S+), pid (\d+)\) has not reached (.+) for \d+ s "
                   r"\(stopped\? SIGSTOP, a debugger, swapping\); seen by rank (\d+) \(distributed\."
                   r"step_timeout_s: 3 s\); rank (\d+) closed its cache, the job ends$")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _mapped() -> set[str]:
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        mapped |= {ln.split(None, 5)[-1].removesuffix(" (deleted)") for ln in lines if "/dev/shm/" in ln}
    return mapped


def _left(before: set[str]) -> set[str]:
    """Files that appeared in /dev/shm and that no live process maps."""
    mapped = _mapped()
    return {n for n in _shm() - before if f"/dev/shm/{n}" not in mapped}


def _job(tmp_path, np: int, **distributed):
    """A tiny job; with replicas, of fewer requests (rank 0 describes how the whole trace
    is routed before the first step: seconds for the usual 100,000)."""
    disk = tmp_path / "disk"
    cfg = tiny_config(tmp_path, disk_dir=disk,
                      distributed={"consensus_timeout_s": 20, "step_timeout_s": STEP_TIMEOUT_S,
                                   **distributed},
                      workload={"requests": 2000} if distributed.get("tp_size") else {})
    proc = start(["run", "--config", str(cfg), "--quiet", "--out", str(tmp_path / "runs")], np=np)
    return proc, disk


def _named_lines(proc, until: float) -> tuple[list[tuple[float, str]], str]:
    """stderr lines as they come (with their arrival time) until the job ends or ``until``."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    got, rest = [], []
    while time.monotonic() < until:
        if not sel.select(timeout=max(0.0, until - time.monotonic())):
            continue
        line = proc.stderr.readline()
        if not line:
            break
        (got if NAMED.match(line) else rest).append((time.monotonic(), line.rstrip("\n")))
    return got, "\n".join(ln for _, ln in rest)


def _stop_and_watch(tmp_path, np: int, victim: int, header: str, **distributed):
    before = _shm()
    proc, disk = _job(tmp_path, np, **distributed)
    try:
        wait_for_line(proc, header)
        # Rank 0 prints the header after its set-up; let every rank finish its first
        # step: until then the start-up's bound applies (consensus_timeout_s, 20 s).
        time.sleep(1.5)
        pid = rank_pid(proc, victim)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        named, other = _named_lines(proc, stopped + 60)
        code, _, _ = finish(proc, timeout=30)
    finally:
        kill_job(proc)
    return dict(pid=pid, stopped=stopped, named=named, other=other, code=code, disk=disk, before=before)


def _check(run: dict, np: int, victim: int) -> None:
    host = os.uname().nodename
    lines = [ln for _, ln in run["named"]]
    assert run["code"] == 3, "\n".join([*lines, run["other"]])
    said = sorted(int(NAMED.match(ln).group(6)) for ln in lines)
    assert said == [r for r in range(np) if r != victim], "\n".join([*lines, run["other"]])
    for ln in lines:
        m = NAMED.match(ln)
        assert (int(m.group(1)), m.group(2), int(m.group(3))) == (victim, host, run["pid"]), ln
        assert m.group(4), ln  # the collective: the step's agreement, the model's allreduce, ...
        assert int(m.group(5)) != victim, ln
    late = [round(t - run["stopped"], 2) for t, _ in run["named"]]
    print(f"named {late} s after SIGSTOP (step_timeout_s {STEP_TIMEOUT_S:g})")
    assert max(late) <= STEP_TIMEOUT_S + 2.0, late
    assert "Traceback" not in run["other"], run["other"]
    assert os.listdir(run["disk"]) == []
    assert _left(run["before"]) == set()


def test_a_stopped_rank_of_a_four_rank_job_is_named_by_every_other_and_the_job_ends(tmp_path):
    run = _stop_and_watch(tmp_path, 4, 2, "kvdist run: 4 ranks")
    _check(run, 4, 2)


@pytest.mark.parametrize("victim", [1, 2])
def test_a_stopped_rank_of_a_replicas_job_is_named_by_every_other_and_the_job_ends(tmp_path, victim):
    """2 replicas x TP 2: the stopped rank's TP peer finds it; the other replica learns
    it by message (no collective spans replicas) and ends too."""
    run = _stop_and_watch(tmp_path, 4, victim, "kvdist run: 4 ranks", tp_size=2)
    _check(run, 4, victim)


def test_sigterm_to_one_rank_of_a_replicas_job_stops_every_rank_at_once(tmp_path):
    """The world rank is named (not its TP rank), every replica stops within seconds
    (the other replica used to wait 60 s in close and end with tracebacks, exit 1)."""
    before = _shm()
    proc, disk = _job(tmp_path, 4, tp_size=2)
    try:
        wait_for_line(proc, "kvdist run: 4 ranks")
        os.kill(rank_pid(proc, 3), signal.SIGTERM)
        sent = time.monotonic()
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_job(proc)
    took = time.monotonic() - sent
    print(f"the job ended {took:.1f} s after the SIGTERM")
    assert code == 128 + signal.SIGTERM, (out, err)
    assert [ln for ln in err.splitlines() if ln.startswith("kvdist: ")] == \
        ["kvdist: stopped by SIGTERM on rank 3; caches closed"], err
    assert "Traceback" not in err and "BAD TERMINATION" not in out
    assert took < 15, took
    assert os.listdir(disk) == []
    assert _left(before) == set()
