"""The experiment around the engine (``kvdist.sim.engine``): the seeded trace
(``workload``), routing and admission across replicas, the step loop driving the
cache (``driver``), the checks and shadow caches, the ceiling, and the reports."""
