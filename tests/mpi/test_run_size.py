"""The main job's run-size check is agreed: a rank whose node has too little memory
for the trace stops every rank with the same one-line mistake (alone, it would leave
the others waiting in the run's first collective)."""

import pytest

import kvdist
from kvdist.sim.experiment import preflight
from kvdist.sim.experiment.budget import REQUEST_OVERHEAD
from tests.conftest import make_cfg

pytestmark = pytest.mark.mpi


def test_a_rank_short_of_memory_stops_every_rank_alike(monkeypatch):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    short = world.size - 1
    monkeypatch.setattr(preflight, "available_memory",
                        lambda: 10 * REQUEST_OVERHEAD if world.rank == short else 1 << 40)
    cfg = kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 1024}}, workload={"requests": 50}))
    with pytest.raises(kvdist.ConfigError, match="the trace") as ei:
        preflight.check_run_size(cfg, None, comm=world)
    assert (ei.value.key, ei.value.value) == ("workload.requests", 50)
    assert len(set(world.allgather(str(ei.value)))) == 1  # the same line on every rank
    monkeypatch.setattr(preflight, "available_memory", lambda: 1 << 40)
    preflight.check_run_size(cfg, None, comm=world)  # every rank fits: no error anywhere
