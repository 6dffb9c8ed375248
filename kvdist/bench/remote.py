"""``python -m kvdist bench remote``: fetching blocks from a peer replica, against the
transport's own ceiling, side by side in one run (``mpiexec -n 2``: rank 0 holds,
rank 1 fetches; ``--fetcher R`` makes rank R fetch, e.g. one on another node for the
MPI path across nodes).

For each block size, 2,048 blocks scattered over the holder's host tier (slots drawn
at random) are fetched into slots scattered over the fetcher's landing tier:

  shared   the one-node transport: stamps read, a batched copy straight from the
           holder's mapped (pinned) host tier into the fetcher's GPU tier (host memory
           on a CPU machine), stamps read again — what a remote hit costs;
           ceilings: one contiguous copy of the same bytes from the peer's mapping,
           and (CUDA) from this rank's own pinned memory: the host->GPU ceiling;
  messages the MPI transport: one request, a message per block straight from the
           holder's slot into the landing host slot, the trailer; the holder serves it
           between polls; ceiling: one contiguous MPI Send/Recv of the same bytes
           between the two ranks; next to it, MPI's own figure for the same blocks (a
           plain Isend/Irecv per block between the same slots, Waitall on both sides).

``--upkeep`` measures something else: what the directory and the TP group's
agreements add to the per-step cache bookkeeping (``kvdist.bench.remote_upkeep``).
Figures are medians of ``--rounds``; the shared rows need both ranks on one node."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import time

import numpy as np
import torch
from tabulate import tabulate

from ..blocks import GPU, HOST
from ..distributed.message_server import MessageServer
from ..distributed.message_transport import MessageTransport
from ..distributed.peer_copy import make_copier
from ..distributed.remote import shm_dir
from ..distributed.shared_transport import SharedTransport
from ..distributed.stamps import SlotStamps
from ..distributed.transport import LANDED, Batch
from ..layout import KVLayout
from ..storage import GpuPool, HostPool
from ..transfer import HostCopies, SyncExecutor

SIZES = {"128KiB": 128 << 10, "512KiB": 512 << 10, "2MiB": 2 << 20}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvdist bench remote", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2048, help="blocks fetched (default 2048)")
    p.add_argument("--sizes", default="128KiB,512KiB,2MiB", help=f"block sizes, from {', '.join(SIZES)}")
    p.add_argument("--rounds", type=int, default=5, help="rounds; figures are medians (default 5)")
    p.add_argument("--device", default="auto", help="the fetcher's landing device: auto, cpu, cuda:N")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--fetcher", type=int, default=1,
                   help="the fetching rank (rank 0 holds); on two nodes pick one on the other node")
    p.add_argument("--holder-step-ms", type=float, default=0.0,
                   help="the holder answers only between steps of this many ms (busy, no MPI call), "
                        "as a serving holder does (the contiguous transfer then waits for its step "
                        "too); default 0: it answers at once")
    p.add_argument("--upkeep", action="store_true", help="measure directory upkeep instead (any -n)")
    p.add_argument("--steps", type=int, default=300, help="--upkeep: steps per run (default 300)")
    p.add_argument("--tp", type=int, default=2, help="--upkeep: TP ranks per replica (default 2)")
    p.add_argument("--admit", type=int, default=2, help="--upkeep: prompts admitted a step (default 2)")
    p.add_argument("--decode", type=int, default=4,
                   help="--upkeep: steps each sequence decodes (default 4; a batch of about admit x decode)")
    p.add_argument("--at-scale", default=None, metavar="R,T,N",
                   help="print the directory's memory and messages a step on paper for R replicas "
                        "x TP T over N nodes (e.g. 64,8,8; no ranks needed)")
    p.add_argument("--host-slots", type=int, default=None,
                   help="--at-scale: host-tier slots a rank (default: configs/h200.yaml's 12,288)")
    p.add_argument("--changes", type=int, default=None,
                   help="--at-scale: host-slot changes a step a rank (default 44, as in --upkeep)")
    p.add_argument("--every", type=int, default=None,
                   help="--upkeep: directory messages every this many steps (default: the config's)")
    return p.parse_args(argv)


def _layout(size: int) -> KVLayout:
    return KVLayout(1, 1, size // 32, "uint8", 16)  # 2 x 16 tokens x 1 head x size/32 bytes


class DetachedSlots:
    """The landing side's view of a cache, for transports driven by hand: slots are
    tier-local (base 0), nothing else touches them."""

    tokens_per_block = 16

    def __init__(self, executor):
        self.executor = executor

    def tier_base(self, tier: int) -> int:
        return 0

    def pending_events(self, slots) -> list:
        return []


def _fetch(transport, batch: Batch, serve=None) -> float:
    """Seconds until every block of ``batch`` landed (checked)."""
    t0 = time.perf_counter()
    transport.start(batch)
    while not batch.resolved:
        if serve is not None:
            serve()
        transport.poll(batch, time.monotonic())
    dt = time.perf_counter() - t0
    assert (batch.state == LANDED).all(), f"{int((batch.state != LANDED).sum())} blocks did not land"
    return dt


def _batch(peer_slots: np.ndarray, dst: np.ndarray, tier: int) -> Batch:
    hi = (peer_slots + 1).astype(np.uint64)  # the stamps' hashes: slot + 1, 0
    return Batch(0, peer_slots, hi, np.zeros(len(peer_slots), dtype=np.uint64), dst, tier,
                 time.monotonic() + 3600)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _quiet_barrier(comm) -> None:
    """A barrier that sleeps while it waits: ranks with nothing to do leave the cores
    to the two that measure."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def _contiguous(dst: torch.Tensor, src: torch.Tensor, chunk_rows: int) -> None:
    """All the bytes in one copy per CUDA registration of ``src`` (a pinned host tier
    is registered in chunks of ``chunk_rows`` blocks, and the driver refuses a copy that
    spans two): a DMA into CUDA memory, a memcpy on the host."""
    if dst.device.type == "cuda":
        for lo in range(0, len(src), chunk_rows):
            dst[lo:lo + chunk_rows].copy_(src[lo:lo + chunk_rows], non_blocking=True)
    else:
        np.copyto(dst.numpy(), src.numpy())


class Holder:
    """Rank 0: a host tier in a shared file, filled, every slot stamped valid."""

    def __init__(self, layout: KVLayout, n: int, token: str, device: torch.device, comm):
        pin = device.type == "cuda"
        self.pool = HostPool(layout, n, pin=pin, device=device if pin else None, progress=False,
                             shared_path=os.path.join(shm_dir(), f"kvdist-bench-{token}.host"))
        self.pool.raw.view(-1)[:: 4096].random_(0, 255)  # touch, vary
        path = os.path.join(shm_dir(), f"kvdist-bench-{token}.stamps") if self.pool.shared_path else None
        self.stamps = SlotStamps(n, path)
        slots = np.arange(n)
        self.stamps.publish(slots, (slots + 1).astype(np.uint64), np.zeros(n, dtype=np.uint64))
        self.server = MessageServer(comm, self.pool.raw, self.stamps)


def run_sizes(args, comm, device: torch.device) -> list[dict]:
    from mpi4py import MPI

    rank = comm.Get_rank()
    rows = []
    rng = np.random.default_rng(0)
    for name in [s.strip() for s in args.sizes.split(",")]:
        size, n = SIZES[name], args.blocks
        layout = _layout(size)
        cap = n * 5 // 4  # slots drawn from a quarter more than the blocks fetched
        token = comm.bcast(secrets.token_hex(6) if rank == 0 else None, root=0)
        holder = Holder(layout, cap, token, device, comm) if rank == 0 else None
        info = comm.bcast((holder.pool.shared_path, holder.stamps.shared_path,
                           MPI.Get_processor_name(), holder.pool.shared_error) if rank == 0 else None, root=0)
        src = np.sort(rng.choice(cap, n, replace=False))[rng.permutation(n)]
        dst = np.sort(rng.choice(cap, n, replace=False))[rng.permutation(n)]
        nbytes = n * size
        row = {"size": name, "blocks": n}
        if rank == args.fetcher:
            row.update(_fetcher(args, comm, device, layout, cap, info, src, dst, nbytes))
        else:
            _serve(args, comm, holder, nbytes, src)
        _quiet_barrier(comm)
        if holder is not None:
            holder.server.close()
            holder.stamps.close()
            holder.pool.close()
        rows.append(comm.bcast(row if rank == args.fetcher else None, root=args.fetcher))
    return rows


def _blocks(comm, peer: int, rows: np.ndarray, slots: np.ndarray, send: bool) -> None:
    """MPI's own figure for the blocks: one message per block between the same slots,
    all posted at once, completed by Waitall (no transport, no Python in between)."""
    from mpi4py import MPI

    op = comm.Isend if send else comm.Irecv
    MPI.Request.Waitall([op([rows[s], MPI.BYTE], peer, 95) for s in slots.tolist()])


def _busy(seconds: float) -> None:
    """A step of the holder's own work: no MPI call (a forward pass)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _serve(args, comm, holder: Holder | None, nbytes: int, slots: np.ndarray) -> None:
    """Rank 0 (and idle ranks): answer fetches until the fetcher says stop; send the
    contiguous ceiling's bytes, and the blocks as plain MPI messages."""
    from mpi4py import MPI

    if holder is None:
        return
    fetcher = args.fetcher
    stop = comm.irecv(source=fetcher, tag=99)
    while True:
        done, _ = stop.test()
        if done:
            break
        holder.server.service()
        if args.holder_step_ms:
            _busy(args.holder_step_ms / 1000)
        if comm.Iprobe(source=fetcher, tag=98):
            if comm.recv(source=fetcher, tag=98) == "blocks":
                _blocks(comm, fetcher, holder.pool.raw.numpy(), slots, send=True)
                continue
            flat = holder.pool.raw.numpy().reshape(-1)[:nbytes]
            comm.Send([flat, nbytes, MPI.BYTE], dest=fetcher, tag=97)


def _fetcher(args, comm, device, layout, cap, info, src, dst, nbytes) -> dict:
    from mpi4py import MPI

    host_path, stamps_path, holder_node, shm_error = info
    pin = device.type == "cuda"
    landing_host = HostPool(layout, cap, pin=pin, device=device if pin else None, progress=False)
    gpu = GpuPool(layout, cap, device)
    if pin:
        from ..transfer.cuda import CudaExecutor

        executor = CudaExecutor(gpu, landing_host, None, device)
    else:
        executor = SyncExecutor(HostCopies(gpu, landing_host, None))
    slots = DetachedSlots(executor)
    out: dict = {"device": str(device), "shm_error": shm_error}
    same_node = holder_node == MPI.Get_processor_name() and host_path is not None
    rounds: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        rounds.setdefault(key, []).append(nbytes / seconds / 1e9)

    peer = stamps = copier = None
    if same_node:
        peer = HostPool(layout, cap, pin=pin, device=device if pin else None, shared_path=host_path,
                        attach=True)
        stamps = SlotStamps(cap, stamps_path, attach=True)
        copier = make_copier(device, False, executor)
        shared = SharedTransport(peer, stamps, {GPU: gpu.raw, HOST: landing_host.raw}, copier, slots)
    messages = MessageTransport(comm, landing_host.raw, slots, executor)
    n = len(src)
    flat_dst = landing_host.raw.numpy().reshape(-1)[:nbytes]
    for _ in range(args.rounds + 1):
        if same_node:
            add("shared", _fetch(shared, _batch(src, dst, GPU)))
            add("shared_contiguous",
                _timed(lambda: _contiguous(gpu.raw[:n], peer.raw[:n], peer.chunk_blocks), device))
            if pin:
                add("own_pinned_contiguous",
                    _timed(lambda: _contiguous(gpu.raw[:n], landing_host.raw[:n], landing_host.chunk_blocks),
                           device))
        add("messages", _fetch(messages, _batch(src, dst, HOST), serve=messages.progress))
        t0 = time.perf_counter()
        comm.send("blocks", dest=0, tag=98)
        _blocks(comm, 0, landing_host.raw.numpy(), dst, send=False)
        add("mpi_blocks", time.perf_counter() - t0)
        t0 = time.perf_counter()
        comm.send(None, dest=0, tag=98)
        comm.Recv([flat_dst, nbytes, MPI.BYTE], source=0, tag=97)
        add("mpi_contiguous", time.perf_counter() - t0)
    comm.send(None, dest=0, tag=99)
    for key, values in rounds.items():
        out[key] = statistics.median(values[1:])  # the first round maps and faults the pages in
    out["rounds"] = rounds
    flat_dst = None  # no view of the landing tier outlives it
    if same_node:
        shared.close([])
    messages.close([])
    executor.close()
    landing_host.close()
    gpu.close()
    return out


def _report(rows: list[dict], header: str) -> str:
    table = []
    for r in rows:
        sh = r.get("shared")
        ceil = r.get("own_pinned_contiguous") or r.get("shared_contiguous")
        table.append([r["size"], r["blocks"],
                      f"{sh:.1f}" if sh else "-",
                      f"{r['shared_contiguous']:.1f}" if sh else "-",
                      f"{r['own_pinned_contiguous']:.1f}" if r.get("own_pinned_contiguous") else "-",
                      f"{100 * sh / ceil:.0f}%" if sh else "-",
                      f"{r['messages']:.2f}", f"{r['mpi_blocks']:.2f}", f"{r['mpi_contiguous']:.2f}",
                      f"{100 * r['messages'] / r['mpi_contiguous']:.0f}%"])
    return header + "\n" + tabulate(table, headers=[
        "block", "blocks", "shared GB/s", "peer contig.", "own pinned contig.", "shared/ceiling",
        "messages GB/s", "MPI per block", "MPI contig.", "messages/MPI"], tablefmt="simple")


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.at_scale:
        return _at_scale(args)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    try:
        if args.upkeep:
            from .remote_upkeep import run_upkeep

            return run_upkeep(args, comm)
        if comm.Get_size() < 2 or not 0 < args.fetcher < comm.Get_size():
            print("bench remote needs two ranks: mpiexec -n 2 python -m kvdist bench remote")
            return 2
        spec = args.device
        device = torch.device("cuda" if spec == "auto" and torch.cuda.is_available() else
                              "cpu" if spec == "auto" else spec)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", comm.Get_rank() % torch.cuda.device_count())
        rows = run_sizes(args, comm, device)
        nodes = len(set(comm.allgather(MPI.Get_processor_name())))
        if comm.Get_rank() == 0:
            where = rows[0].get("device", "?")
            print(_report(rows, f"bench remote: rank {args.fetcher} fetches {args.blocks} scattered blocks "
                                f"from rank 0 ({nodes} node(s)), landing on {where}; medians of "
                                f"{args.rounds} rounds"))
            for r in rows:
                if r.get("shm_error"):
                    print(f"{r['size']}: no shared rows: the holder's host tier is not in shared memory "
                          f"({r['shm_error']})")
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(rows, f, indent=1)
        return 0
    finally:
        comm.Free()


def _at_scale(args: argparse.Namespace) -> int:
    from .remote_scale import Deployment, report

    try:
        replicas, tp, nodes = (int(x) for x in args.at_scale.split(","))
        if min(replicas, tp, nodes) < 1 or replicas % nodes:
            raise ValueError
    except ValueError:
        print(f"--at-scale {args.at_scale}: expected R,T,N, positive, with R a multiple of N")
        return 2
    given = {k: v for k, v in (("host_slots", args.host_slots), ("changes", args.changes),
                                ("every", args.every)) if v is not None}
    print(report(Deployment(replicas, tp, nodes, **given)))
    return 0
