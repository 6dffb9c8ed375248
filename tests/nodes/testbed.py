"""Two nodes on one machine: the multi-node test bed.

Each node is a network namespace holding one end of a veth pair, addressed on a private
/30 the bed picks itself (``10.213.x.y/30`` from its tag, the creating process's pid);
nothing else is addressed and nothing routes anywhere else. Commands enter a node
through ``node-ssh`` (next to this file; the bed writes ``<root>/ssh`` for it), which
gives the node its own host name, ``/etc/hosts``, ``/sys``, ``/dev/shm``, IPC, scratch
directory (seen by every node at the same path, ``<root>/scratch``, as a node-local disk
would be) and optionally its own ``/proc/meminfo``. MPI launchers use ``<root>/ssh`` to
start the ranks of the other node, so MPI sees two hosts, uses its shared-memory
transport only inside each and TCP over the veth pair between them.

Names carry the tag (``kvn<pid>a``/``kvn<pid>b`` are the namespaces, their veth ends
and the host names), so concurrent runs never collide, and :meth:`TwoNodes.down`
removes everything the bed created: the processes still inside its namespaces, the
veth pair, the namespaces, its directory. :func:`sweep` removes what a run killed before
its clean-up (SIGKILL) left behind. Needs root, ``ip`` (iproute2), ``unshare`` and
``nsenter`` (util-linux).

    python -m tests.nodes.testbed -- COMMAND...    # COMMAND on node a, then tear down
    python -m tests.nodes.testbed --sweep          # remove what killed runs left
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE_SSH = HERE / "node-ssh"
ROOT_PREFIX = "kvdist-nodes-"
NAME = re.compile(r"kvn(\d+)[ab]")
TOOLS = ("ip", "unshare", "nsenter", "mount")
# What the nodes' /proc/meminfo shows as available in the tests (node b less than node a).
MEM_AVAILABLE = {"a": 64 << 20, "b": 48 << 20}


class BedUnavailable(RuntimeError):
    """This machine cannot host the bed (not root, tools missing, namespaces refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which("ip") is None:  # no bed can exist: nothing to list or remove
        if check:
            raise BedUnavailable("no ip (iproute2)")
        return subprocess.CompletedProcess(["ip", *args], 127, "", "")
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, encoding="utf-8")
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def unavailable() -> str | None:
    """Why the bed cannot run here (one line), or None. Tries the namespaces and mounts a
    node needs in throw-away namespaces that vanish with the probe."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux; `make test` installs them)"
    probe = ("mount -t tmpfs tmpfs /dev/shm && umount -l /sys && mount -t sysfs sysfs /sys"
             " && echo probe > /proc/sys/kernel/hostname")
    out = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "--propagation", "private",
                          "--", "sh", "-c", probe], capture_output=True, text=True, timeout=30,
                              encoding="utf-8")
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return f"cannot create namespaces here: {why}"
    return None


def names(tag: int) -> tuple[str, str]:
    """The two nodes' names (namespace, veth end, host name) for a bed's tag."""
    return f"kvn{tag}a", f"kvn{tag}b"


def subnet(tag: int) -> tuple[str, str]:
    """The nodes' addresses: a /30 of 10.213.0.0/16 picked from the tag."""
    third, fourth = (tag >> 6) & 255, (tag & 63) << 2
    return f"10.213.{third}.{fourth + 1}", f"10.213.{third}.{fourth + 2}"


def meminfo_with(available: int) -> str:
    """This machine's /proc/meminfo with MemAvailable replaced (bytes, kB granularity)."""
    with open("/proc/meminfo", encoding="utf-8") as f:
        text = f.read()
    return re.sub(r"^MemAvailable:\s+\d+ kB$", f"MemAvailable: {available // 1024:>8} kB", text,
                  flags=re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    address: str
    dir: Path  # <root>/nodes/<name>: scratch/ (the node's disk), meminfo (optional)

    @property
    def scratch(self) -> Path:
        return self.dir / "scratch"


class TwoNodes:
    """A bed of two nodes, ``a`` and ``b``. ``mem_available`` gives a node its own
    /proc/meminfo showing that many bytes available (keyed ``a``/``b``)."""

    def __init__(self, tag: int | None = None, mem_available: Mapping[str, int] | None = None):
        self.tag = os.getpid() if tag is None else tag
        self.mem_available = dict(mem_available or {})
        self.root: Path | None = None
        self.nodes: tuple[Node, Node] | None = None

    # -- paths of a bed that is up --------------------------------------------------------
    @property
    def ssh(self) -> Path:
        """The ssh stand-in for MPI launchers: ``ssh HOST COMMAND...``."""
        return self._root / "ssh"

    @property
    def hostfile(self) -> Path:
        return self._root / "hostfile"

    @property
    def scratch(self) -> Path:
        """Where every node sees its own scratch directory."""
        return self._root / "scratch"

    @property
    def _root(self) -> Path:
        assert self.root is not None, "the bed is not up"
        return self.root

    # -- up and down ----------------------------------------------------------------------
    def up(self) -> TwoNodes:
        """Create the bed; on any error, remove what was created and raise."""
        why = unavailable()
        if why:
            raise BedUnavailable(why)
        self.root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{self.tag}-"))
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        return self

    def _create(self) -> None:
        root = self._root
        (a, b), (addr_a, addr_b) = names(self.tag), subnet(self.tag)
        self.nodes = (Node(a, addr_a, root / "nodes" / a), Node(b, addr_b, root / "nodes" / b))
        self.scratch.mkdir()
        for key, node in zip("ab", self.nodes):
            node.scratch.mkdir(parents=True)
            if key in self.mem_available:
                (node.dir / "meminfo").write_text(meminfo_with(self.mem_available[key]), encoding="utf-8")
        (root / "hosts").write_text("127.0.0.1 localhost\n"
                                    + "".join(f"{n.address} {n.name}\n" for n in self.nodes),
                                    encoding="utf-8")
        self.hostfile.write_text("".join(f"{n.name}\n" for n in self.nodes),
            encoding="utf-8")
        self.ssh.write_text(f'#!/bin/sh\nexec {shlex.quote(str(NODE_SSH))} {shlex.quote(str(root))} "$@"\n',
                             encoding="utf-8")
        self.ssh.chmod(0o755)
        for node in self.nodes:
            try:
                _ip("netns", "add", node.name)
            except RuntimeError as e:  # e.g. /run/netns not writable in a container
                raise BedUnavailable(str(e)) from None
        _ip("link", "add", a, "netns", a, "type", "veth", "peer", "name", b, "netns", b)
        for node in self.nodes:
            n = node.name
            _ip("-n", n, "link", "set", n, "addrgenmode", "none")  # no IPv6 link-local address
            _ip("-n", n, "addr", "add", f"{node.address}/30", "dev", n)
            _ip("-n", n, "link", "set", "lo", "up")
            _ip("-n", n, "link", "set", n, "up")
        self._wait_until_up()

    def _wait_until_up(self, timeout: float = 10.0) -> None:
        """Both veth ends report carrier: until then MPI's transports skip the device."""
        deadline = time.monotonic() + timeout
        while True:
            states = {n.name: _ip("-n", n.name, "-o", "link", "show", n.name).stdout for n in self.nodes}
            if all(" state UP " in line for line in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth pair is not up after {timeout:g} s: {states}")
            time.sleep(0.02)

    def down(self) -> list[str]:
        """Remove everything the bed created; returns what is still there (should be [])."""
        remove(self.tag, self.root)
        return leftovers(self.tag)

    # -- running things -----------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """What the bed tells a job (the launcher forwards ``KVDIST_*`` to every rank): the
        hostfile, the node names, the scratch path, the memory each node's meminfo shows."""
        mem = [self.mem_available.get(k) for k in "ab"]
        return {"KVDIST_HOSTFILE": str(self.hostfile),
                "KVDIST_BED_HOSTS": " ".join(n.name for n in self.nodes),
                "KVDIST_BED_SCRATCH": str(self.scratch),
                "KVDIST_BED_MEM": " ".join(map(str, mem)) if None not in mem else ""}

    def launcher_env(self) -> dict[str, str]:
        """Environment that makes MPICH's Hydra and Open MPI start remote ranks through the
        bed's ssh, as they would through ssh on a cluster."""
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(self.ssh),
                "OMPI_MCA_plm_rsh_agent": str(self.ssh), "PRTE_MCA_plm_ssh_agent": str(self.ssh)}

    def popen(self, node: Node, argv: list[str], env: Mapping[str, str] | None = None,
              **kw) -> subprocess.Popen:
        """Start ``argv`` on ``node`` with this process's environment (plus ``env`` and
        the launcher's), in a new session so that a timeout can kill it whole."""
        full = {**os.environ, **self.launcher_env(), **(env or {})}
        return subprocess.Popen([str(self.ssh), "--keep-env", node.name, shlex.join(argv)], env=full,
                                start_new_session=True, **kw)

    def run(self, node: Node, argv: list[str], env: Mapping[str, str] | None = None,
            timeout: float = 120.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """``argv`` on ``node`` (in ``cwd``): its output, or TimeoutExpired after killing it."""
        proc = self.popen(node, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=cwd, encoding="utf-8")
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (it was started with start_new_session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def pids_in(netns: str) -> list[int]:
    """The processes inside the network namespace ``netns``."""
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def remove(tag: int, root: Path | None) -> None:
    """Kill the processes inside the bed's namespaces (all started by the bed), delete
    its veth pair and namespaces, and its directory. Idempotent; never raises for what
    is already gone."""
    pair = names(tag)
    for _ in range(50):
        pids = [p for n in pair for p in pids_in(n)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for n in pair:  # either end deletes both; the first try also covers a half-made pair
        _ip("-n", n, "link", "del", n, check=False)
        _ip("link", "del", n, check=False)
    for n in pair:
        _ip("netns", "del", n, check=False)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def leftovers(tag: int | None = None) -> list[str]:
    """Namespaces, root-namespace links and directories of the bed ``tag`` (of every bed
    when None) that exist now."""
    def ours(name: str) -> bool:
        m = NAME.fullmatch(name)
        return m is not None and (tag is None or int(m.group(1)) == tag)

    listed = _ip("netns", "list", check=False).stdout.splitlines()
    netns = [line.split()[0] for line in listed if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _ip("-o", "link", check=False).stdout.splitlines()]
    prefix = ROOT_PREFIX + ("" if tag is None else f"{tag}-")
    dirs = [str(p) for p in Path(tempfile.gettempdir()).glob(prefix + "*")]
    return ([f"netns {n}" for n in netns if ours(n)] + [f"link {n}" for n in links if ours(n)]
            + [f"dir {d}" for d in dirs])


def sweep() -> list[int]:
    """Remove the beds of runs that died without cleaning up (their pid is gone);
    returns their tags."""
    tags = set()
    for item in leftovers():
        kind, name = item.split(" ", 1)
        m = NAME.fullmatch(name) if kind != "dir" else re.match(rf".*/{ROOT_PREFIX}(\d+)-", name)
        if m:
            tags.add(int(m.group(1)))
    dead = sorted(t for t in tags if not Path(f"/proc/{t}").exists())
    for tag in dead:
        for d in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}{tag}-*"):
            shutil.rmtree(d, ignore_errors=True)
        remove(tag, None)
    return dead


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt (as SIGINT does), so that finally
    blocks and fixture finalizers run when a CI job or `timeout` ends the run."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.nodes.testbed", description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="only remove beds of dead runs")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="run on node a, with $KVDIST_HOSTFILE and the KVDIST_BED_* that "
                        "tests/nodes/ranks_two_nodes.py reads")
    args = p.parse_args(argv)
    if args.sweep:
        print(f"removed the beds of {sweep() or 'no'} dead run(s); left: {leftovers() or 'nothing'}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give a command to run on node a")
    bed = TwoNodes(mem_available=MEM_AVAILABLE)
    with signals_unwind():
        try:
            bed.up()
            a = bed.nodes[0]
            print(f"test bed: nodes {', '.join(f'{n.name} ({n.address})' for n in bed.nodes)}, "
                  f"hostfile {bed.hostfile}, scratch {bed.scratch}", file=sys.stderr, flush=True)
            proc = bed.popen(a, command, bed.env())
            try:
                return proc.wait()
            except KeyboardInterrupt:
                kill_session(proc)
                return 130
        except BedUnavailable as e:
            print(f"test bed unavailable: {e}", file=sys.stderr)
            return 77
        finally:
            left = bed.down()
            if left:
                print(f"test bed: could not remove {left}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
