"""The two-node test bed as a fixture: created once per session (skipped, with the
reason, where namespaces cannot be created) and always removed afterwards, also when a
test fails, times out, or the run is ended by SIGINT, SIGTERM or SIGHUP."""

from __future__ import annotations

import pytest

from tests.nodes import testbed


@pytest.fixture(scope="session")
def bed():
    why = testbed.unavailable()
    if why:
        pytest.skip(f"two-node test bed: {why}")
    testbed.sweep()
    with testbed.signals_unwind():
        try:
            nodes = testbed.TwoNodes(mem_available=testbed.MEM_AVAILABLE).up()
        except testbed.BedUnavailable as e:
            pytest.skip(f"two-node test bed: {e}")
        try:
            yield nodes
        finally:
            left = nodes.down()
            assert not left, f"the test bed left {left}"
