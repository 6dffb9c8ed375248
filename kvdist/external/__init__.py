"""``cache.gpu: external``: the engine owns the paged KV tensors and the GPU prefix cache;
kvdist keeps its host and disk tiers and moves blocks between them and the engine's
block ids (docs/design.md, "An engine-owned GPU tier").

Two sides, as an engine's KV connector has them:

* the scheduler's, :class:`ExternalPlanner` (no tensors, no MPI): ``lookup`` (tokens
  kvdist holds beyond the engine's GPU hit), ``plan_load`` into the engine's block ids,
  ``saveable`` / ``plan_save`` out of them, ``take`` the ordered copies for the step's
  metadata;
* each worker rank's, :class:`ExternalCache` from :func:`create` (collective):
  ``register`` the KV tensors, ``start`` the step's copies, ``wait_layer`` before a
  layer's attention, ``finished`` / ``failed_blocks`` to poll completions, ``end_step``
  at every step's end (the remote tier's agreement, when it is on);
* with ``distributed.remote``, each worker rank's :class:`PeerTier` (``ExternalCache.peers``):
  the planner of the rank's process asks it which blocks other replicas hold
  (``ExternalPlanner(..., peers=cache.peers)``), and it fetches them."""

from .build import create
from .cache import ExternalCache, Finished
from .peers import PeerTier
from .plan import Fetch, Job, LoadPlan, Prompt, SavePlan, TierPlan, Transfers
from .planner import ExternalPlanner, PeerLookup, tier_plan
from .tier import ExternalGpuTier

__all__ = ["ExternalCache", "ExternalGpuTier", "ExternalPlanner", "Fetch", "Finished", "Job", "LoadPlan",
           "PeerLookup", "PeerTier", "Prompt", "SavePlan", "TierPlan", "Transfers", "create", "tier_plan"]
