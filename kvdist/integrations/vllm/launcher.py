"""vLLM's TP workers started by ``mpiexec``, one engine per process
(``distributed_executor_backend="external_launcher"``): how the ranks find each other.

vLLM's external launcher joins its processes by ``torch.distributed``'s ``env://``
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as
``torchrun`` sets them); kvdist's workers join by MPI (the start-up consensus over a Dup
of ``COMM_WORLD``), and agree each step on what they report (``agree``). Under
``mpiexec`` both are one call away: ``launcher_env()`` at the top of the script, before
``LLM(...)``, fills vLLM's variables from MPI (the rank, the node-local rank, the size,
rank 0's address and a port it found free), keeping any already set. ``torchrun`` alone
(no MPI) leaves every worker's kvdist a job of its own, which the worker refuses
(``WorkerSide.register_kv_caches``)."""

from __future__ import annotations

__all__ = ["launcher_env"]

import os
import socket
from collections.abc import MutableMapping


def _free_port(addr: str) -> int:
    """A TCP port free on ``addr`` now (bound to port 0, then released for torch's store)."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def launcher_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
    ``environ`` (``os.environ``) from MPI where they are not set; returns the five as
    set. Collective over ``COMM_WORLD`` (a Dup of it): every rank calls it."""
    from mpi4py import MPI

    env = os.environ if environ is None else environ
    comm = MPI.COMM_WORLD.Dup()
    try:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.rank
        node.Free()
        addr = port = None
        if comm.rank == 0:
            from vllm.utils.network_utils import get_ip

            addr = env.get("MASTER_ADDR") or get_ip()
            port = env.get("MASTER_PORT") or str(_free_port(addr))
        addr, port = comm.bcast((addr, port), root=0)
        values = {"RANK": str(comm.rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(comm.size),
                  "MASTER_ADDR": addr, "MASTER_PORT": port}
    finally:
        comm.Free()
    for key, value in values.items():
        env.setdefault(key, value)
    return {key: env[key] for key in values}
