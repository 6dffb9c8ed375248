"""Deliberately failing tests, run in a child pytest by ``test_testbed.py`` (no ``test_``
prefix: never collected on their own). Each leaves a process running inside node b;
the bed fixture must still remove everything when the session ends."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.nodes import testbed


def sleeping(bed) -> bool:
    """Whether the sleep runs in node b (node-ssh's set-up processes come and go)."""
    for pid in testbed.pids_in(bed.nodes[1].name):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip() == "sleep":
                return True
    return False


def start_sleep(bed):
    return bed.popen(bed.nodes[1], ["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def report(bed) -> None:
    """Once the sleep runs inside node b, tell the parent what exists: the bed's tag,
    what of it is listed, the pids inside node b."""
    deadline = time.monotonic() + 30
    while not sleeping(bed):
        assert time.monotonic() < deadline, "the sleep never started in node b"
        time.sleep(0.02)
    path = Path(os.environ["KVDIST_DRILL_REPORT"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"tag": bed.tag, "leftovers": testbed.leftovers(bed.tag),
                               "pids": testbed.pids_in(bed.nodes[1].name)}), encoding="utf-8")
    tmp.replace(path)


def test_fails_with_a_process_left_in_node_b(bed):
    start_sleep(bed)
    report(bed)
    raise AssertionError("deliberate failure")


def test_times_out(bed):
    with pytest.raises(subprocess.TimeoutExpired):
        bed.run(bed.nodes[1], ["sleep", "600"], timeout=1)
    raise AssertionError("deliberate failure after a timeout")


def test_hangs_until_killed(bed):
    proc = start_sleep(bed)
    report(bed)
    proc.wait()
