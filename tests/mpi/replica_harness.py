"""Driving replicas in the remote-tier MPI tests: replica 0 holds, replica 1 fetches,
any further replica idles. Written for ``mpiexec -n 4`` (2 replicas x TP 2), valid at
any world size of at least 2 (TP 2 when the world is even and >= 4, else TP 1).

``KVDIST_TEST_DEVICE=cuda:0`` runs them with the GPU tier on that device (every rank
on the one GPU): the CUDA paths of the transports (a DMA from the peer's registered
mapping, pinned host landing slots)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from contextlib import contextmanager

import pytest
import xxhash

from kvdist.distributed.remote_rules import REMOTE_RULES
from kvdist.testing import IntegrityDriver, Seams, create
from tests.conftest import make_cfg
from tests.mpi.job import abort_job

BLOCK = 512  # bytes per block of tests.conftest.BASE (4 tokens)
PROMPT = list(range(1000, 1033))  # 8 full blocks reusable (the 33rd token is computed)
FULL = 8
HOLDER, FETCHER = 0, 1
DEVICE = os.environ.get("KVDIST_TEST_DEVICE", "cpu")


def tp_size(world: int) -> int:
    return 2 if world % 2 == 0 and world >= 4 else 1


def need_replicas(world: int) -> None:
    if world // tp_size(world) < 2:
        pytest.skip("needs two replicas")


def config(transport: str = "auto", timeout_ms: float = 3000, simulate: bool = False,
           gpu: int = 16, host: int = 32, world: int = 4, every: int = 1, policy: bool = True) -> dict:
    """Directory messages every ``every`` steps (1 here: the tests count exact misses,
    which a directory lagging by steps would change). ``policy``: the recompute policy's
    per-step MIN-reduce, which the remote tier's agreement rides on at ``end_step``
    (without it the tier agrees at ``begin_step``)."""
    return make_cfg(
        cache={"gpu": {"blocks": gpu}, "host": {"bytes": host * BLOCK}, "simulate_async": simulate,
               "device": DEVICE, "recompute_when_faster": policy},
        distributed={"tp_size": tp_size(world), "consensus_timeout_s": 30,
                     "remote": {"enabled": True, "fetch_timeout_ms": timeout_ms, "transport": transport,
                                "directory_every_steps": every}})


class Replica:
    """One rank's cache (built with test seams: ``remote_rules``, and the handles to
    its remote tier and manager) and integrity driver (its pattern salted by the TP
    rank, so a shard fetched from the wrong TP index would show as wrong bytes).

    A context manager: the cache is closed when the test's body ends, unless it ended
    with a failure. Then the other ranks may be anywhere — in a collective of the test,
    or in ``close``'s own, which would wait out ``consensus_timeout_s`` — so the failing
    rank prints the failure and ends the whole job at once."""

    def __init__(self, cfg: dict, rules: frozenset[str] = REMOTE_RULES):
        from mpi4py import MPI

        self.world = MPI.COMM_WORLD
        self.seams = Seams(remote_rules=rules)
        self.cache = create(cfg, self.seams)
        self.remote = self.seams.remote
        self.d = IntegrityDriver(self.cache, salt=self.cache.tp_rank)
        self.tp = self.remote.tp  # tests agree inside a replica through its TP group
        self.tables: dict[str, object] = {}

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, pytest.skip.Exception):
            self.cache.close()
            return False
        abort_job(f"a replica test failed on rank {self.world.rank}:\n"
                  + "".join(traceback.format_exception(kind, error, tb)))
        return False  # one rank alone: the error goes on to pytest

    @property
    def replica(self) -> int:
        return self.cache.replica

    def step(self, prompts: dict[str, list[int]] | None = None, *, prefetch: dict | None = None,
             keep: bool = False) -> dict[str, int]:
        """One step: prefetches, prompts admitted and computed; released unless ``keep``."""
        d = self.d
        d.begin()
        for sid, toks in (prefetch or {}).items():
            self.cache.prefetch(sid, toks)
        reused = {sid: d.add(sid, toks) for sid, toks in (prompts or {}).items()}
        if reused:
            table = d.compute()
            for row, sid in enumerate(reused):
                self.tables[sid] = table[row].clone()
        d.end()
        if not keep:
            for sid in reused:
                d.release(sid)
        self.cache.check_invariants()
        return reused

    def hold_prompt(self, prompt: list[int] = PROMPT, fillers: int = 3) -> list[list[str]]:
        """Compute ``prompt``, then push its blocks to the host tier with fillers.
        Returns the per-block, per-layer digests of the prompt's blocks as computed."""
        self.step({"p": prompt}, keep=True)
        digests = self.block_digests("p", FULL)
        self.d.release("p")
        for k in range(fillers):
            self.step({f"f{k}": list(range(5000 + 100 * k, 5040 + 100 * k))})
        hashes = self.prompt_hashes(prompt)
        tiers = [self.remote.slots.tier_of(h) for h in hashes]
        assert tiers == [1] * FULL, f"the prompt's blocks should all be in the host tier: {tiers}"
        return digests

    def prompt_hashes(self, prompt: list[int] = PROMPT) -> list[int]:
        tokens = list(prompt)
        return self.remote.slots.block_hashes(tokens)[: (len(tokens) - 1) // 4]

    def host_slots_of(self, prompt: list[int] = PROMPT) -> list[int]:
        index = self.seams.manager.index
        return [index.find(h) for h in self.prompt_hashes(prompt)]

    def overwrite(self, prompt: list[int] = PROMPT) -> None:
        """Reuse the prompt (its host blocks move to the GPU, their host slots free up),
        then churn until every one of those host slots holds another block."""
        old = self.host_slots_of(prompt)
        self.step({"p2": prompt})
        k = 10
        meta = self.seams.manager.meta
        want = set(self.prompt_hashes(prompt))
        while any(int(meta.state[s]) != 2 or (int(meta.hash_hi[s]) << 64 | int(meta.hash_lo[s])) in want
                  for s in old):
            self.step({f"f{k}": list(range(5000 + 100 * k, 5040 + 100 * k))})
            k += 1
            assert k < 40, "the prompt's old host slots were never reused"

    def block_digests(self, sid: str, n: int) -> list[list[str]]:
        row, pool = self.tables[sid], self.cache.kv_pool
        return [[xxhash.xxh3_64_hexdigest(pool(layer)[int(row[b])].contiguous().cpu().numpy().tobytes())
                 for layer in range(self.cache.layout.num_layers)] for b in range(n)]

    def agreed(self, flag: bool) -> bool:
        """``flag`` true on every rank of this replica (a TP-group MIN)."""
        return bool(self.tp.allreduce_min([int(flag)], "test: agree")[0])

    def wait_for_directory(self, prompt: list[int] = PROMPT, blocks: int = FULL) -> None:
        """Idle steps until this replica's directory lists the prompt's first ``blocks``."""
        hashes = self.prompt_hashes(prompt)
        for _ in range(400):
            if len(self.remote.directory.match(hashes)) >= blocks:
                return
            time.sleep(0.002)
            self.step()
        raise AssertionError("the directory never listed the prompt")

    def serve_until(self, request) -> None:
        """Idle steps (serving peers) until ``request`` (a world Ibarrier) completes on
        every rank of this replica."""
        while not self.agreed(request.Test()):
            self.step()
            time.sleep(0.001)
        request.Wait()


@contextmanager
def within(seconds: float, what: str):
    """Fail (AssertionError naming ``what``) if the body runs longer than ``seconds``:
    a fetch that never gives up then fails the test instead of hanging the suite."""
    def expired(signum, frame):
        raise AssertionError(f"{what}: still running after {seconds:.0f} s")
    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def exchange_digests(r: Replica, digests) -> list | None:
    """The holder's digests, on the fetcher rank of the same TP index."""
    world, T = r.world, r.cache.tp_size
    if r.replica == HOLDER:
        world.send(digests, dest=FETCHER * T + r.cache.tp_rank, tag=77)
        return None
    if r.replica == FETCHER:
        return world.recv(source=HOLDER * T + r.cache.tp_rank, tag=77)
    return None
