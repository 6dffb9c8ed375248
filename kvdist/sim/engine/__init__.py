"""The serving engine the main job drives: continuous batching (``scheduler``), a small
tensor-parallel decoder (``model``, ``parallel``) whose attention reads K/V through
the cache's block table (``attention``, ``paged_decode``), and its CUDA graphs
(``graphs``). It imports nothing of the experiment around it (``kvdist.sim.experiment``)."""
