"""The test bed removes everything it created, whatever happens to the run: a failing
test that leaves a process inside a node, a test whose command timed out, a run ended
by SIGTERM (a CI job's timeout), and — through :func:`testbed.sweep` at the next run — a
run killed outright. Each case runs ``cleanup_drill.py`` in a child pytest, whose pid is
its bed's tag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.nodes import testbed

ROOT = Path(__file__).resolve().parents[2]
DRILL = Path(__file__).with_name("cleanup_drill.py")

UNAVAILABLE = testbed.unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"two-node test bed: {UNAVAILABLE}")


def child(report: Path, *select: str) -> subprocess.Popen:
    env = {**os.environ, "KVDIST_DRILL_REPORT": str(report)}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(DRILL),
                             "-k", " or ".join(select)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8")


def wait_for(report: Path, proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not report.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the drill never reported"
        time.sleep(0.05)
    return json.loads(report.read_text(encoding="utf-8"))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_was_up_and_is_gone(seen: dict, tag: int) -> None:
    a, b = testbed.names(tag)
    assert seen["tag"] == tag and {f"netns {a}", f"netns {b}"} <= set(seen["leftovers"]), seen
    assert seen["pids"], "nothing ran inside node b"
    assert testbed.leftovers(tag) == []
    assert not [p for p in seen["pids"] if alive(p)], seen


def test_failed_and_timed_out_tests_leave_nothing(tmp_path):
    report = tmp_path / "report.json"
    proc = child(report, "fails", "times_out")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "2 failed" in out, out
    assert "deliberate failure after a timeout" in out, out
    assert_was_up_and_is_gone(json.loads(report.read_text(encoding="utf-8")), proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_run_leaves_nothing(tmp_path, sig):
    report = tmp_path / "report.json"
    proc = child(report, "hangs")
    try:
        seen = wait_for(report, proc)
    finally:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    if sig == signal.SIGKILL:  # no finalizer can run: the next run's sweep removes the bed
        assert testbed.leftovers(proc.pid) != []
        assert proc.pid in testbed.sweep()
    else:
        assert "KeyboardInterrupt" in out, out
    assert_was_up_and_is_gone(seen, proc.pid)
