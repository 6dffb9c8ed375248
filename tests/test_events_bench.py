"""``bench events``' runs on a small trace: each mode replays the same moves, and the
timed run hands every step over through the recorder the pool writes into."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from kvdist.bench.events import OFF, PROC, RECORD, run  # noqa: E402
from kvdist.bench.manager import make_trace  # noqa: E402


def test_bench_events_modes_replay_alike_and_the_timed_run_hands_every_step_over():
    trace = make_trace(96, block_size=32, seed=0)
    capacity = (2048, 1024, 1024)
    off = run(trace, capacity, 32, OFF)
    recorded = run(trace, capacity, 32, RECORD)
    timed = run(trace, capacity, 32, PROC, timed=True)
    assert off[2] == recorded[2] == timed[2] > 0  # the same tier moves and drops
    figures = timed[3]
    assert figures["timed_calls"] == trace.steps  # one hand-over a step, each timed
    assert figures["dropped"] == 0 and figures["published"] == figures["submitted"] > 0
