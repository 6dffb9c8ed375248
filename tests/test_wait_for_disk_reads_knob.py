"""``workload.wait_for_disk_reads``: on, the main job's scheduler admits behind the
prefetch gate (a request whose prefix is on disk waits for its reads); off, requests
are admitted at once, as before the gate."""

from __future__ import annotations

from kvdist.sim.experiment.admission import PrefetchGate
from kvdist.sim.experiment.job import solo
from kvdist.sim.experiment.options import RunOptions

from .test_sim_unit import sim_cfg


def test_the_knob_puts_the_gate_in_front_of_the_scheduler_or_leaves_it_out(tmp_path):
    for wait in (True, False):
        cfg = sim_cfg(tmp_path / str(wait))
        cfg = cfg.replace(workload={"wait_for_disk_reads": wait})
        sim = solo(cfg, RunOptions(out=None, progress=False))
        try:
            assert isinstance(sim.parts.gate, PrefetchGate) is wait
            assert (sim.sched.gate is sim.parts.gate) if wait else sim.sched.gate is None
            r = sim.run()
            assert r["ok"] and r["integrity_mismatches"] == 0
        finally:
            sim.close()
