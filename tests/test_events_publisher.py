"""The in-thread publisher (kept for ``bench events``): its thread is not woken by the
step: ``submit`` only queues a batch; the thread publishes what is queued when its
period comes round (or at ``close``), in order, whatever the number waiting."""

from __future__ import annotations

import threading
import time
from array import array

import pytest

pytest.importorskip("zmq")

from kvdist.events.publisher import ThreadPublisher  # noqa: E402
from kvdist.events.recorder import STEP_END  # noqa: E402


def test_submitting_wakes_nothing_and_close_publishes_every_batch_in_order():
    """A period longer than the test: 100 batches submitted (three chunks and more of
    the thread's) are not built while the thread sleeps — the step never hands it the
    interpreter — and all are built on the thread, in order, and sent, at close."""
    built: list[tuple[int, int]] = []  # (record, thread) of each batch built

    def build(step):
        built.append((step[0], threading.get_ident()))
        return []

    pub = ThreadPublisher("tcp://127.0.0.1:0", None, "", 1000, 0, build, linger_s=10.0, period_s=60.0)
    try:
        for i in range(100):
            pub.submit(array("Q", [i, STEP_END, 0]))
        time.sleep(0.3)  # a thread woken per batch would have built them all by now
        assert built == [] and pub.stats()["published"] == 0 and pub.submitted == 100
    finally:
        pub.close()
    assert [r for r, _ in built] == list(range(100))
    assert {t for _, t in built} != {threading.get_ident()} and len({t for _, t in built}) == 1
    assert (pub.stats()["published"], pub.stats()["dropped"]) == (100, 0)
