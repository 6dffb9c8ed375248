"""Connectors that put kvdist's host, disk and remote tiers behind a serving engine's own
KV cache (``cache.gpu: external``). Each engine's connector is a subpackage that imports
that engine; nothing else in kvdist imports them."""
