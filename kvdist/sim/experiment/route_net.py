"""Where the routing of a job of replicas runs on the network: the address its sockets
bind (:func:`bind_host`), the endpoint other nodes connect to (:func:`connectable`), and
the start-up exchange of every replica's endpoints (:func:`exchange`).

Rank 0's router (:mod:`kvdist.sim.experiment.route_feed`) talks to every replica's TP
rank 0: it subscribes to the replica's KV events (``cache.events``: a PUB and a replay
socket, bound by the replica) and pushes routed requests to its inbox (a PULL socket
the replica binds); replicas push finished requests back to the router's own PULL
socket. All of them bind where ``cache.events.endpoint`` says, and nowhere else:

- loopback (``tcp://127.0.0.1:...``, the default; also whenever the events are off or
  not on TCP): the replicas' leaders must then share rank 0's node — :func:`exchange`
  refuses a job where one does not, with one line naming the key;
- an explicit address, ``tcp://*:PORT`` (every interface of the node) or
  ``tcp://IFACE:PORT`` (one interface, the same name on every node): the events bind
  there (the port offset by the replica), the inboxes and the router on the same host
  with a port the system picks.

The endpoints are exchanged once, at the start of a run, by one allgather over the
job's communicator (MPI): each replica leader sends its inbox's and its events'
endpoints as it can be reached from another node (a wildcard bind named by the host
name, which the connecting node resolves, as MPI's hostfile names are)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

from ...config import CacheConfig
from ...errors import ConfigError
from ..engine.parallel import TensorParallel

__all__ = ["LOOPBACK", "bind_host", "connectable", "exchange", "is_loopback"]

LOOPBACK = "127.0.0.1"
_WILDCARDS = ("0.0.0.0", "*", "[::]", "[0:0:0:0:0:0:0:0]")


def bind_host(cfg: CacheConfig) -> str:
    """The host the routing sockets bind (module docstring): ``cache.events.endpoint``'s
    when the events are on over TCP, else loopback."""
    ev = cfg.cache.events
    if not (ev.enabled and ev.endpoint.startswith("tcp://")):
        return LOOPBACK
    return ev.endpoint.removeprefix("tcp://").rpartition(":")[0]


def connectable(bound: str) -> str:
    """The endpoint another node connects to, from one a socket bound (ZMQ's
    ``LAST_ENDPOINT``): the events' rule (``kvdist.events.endpoints.connectable``: a
    wildcard host becomes this host's name), imported here only when called, since
    this module is imported without the events extra."""
    from ...events.endpoints import connectable as events_connectable

    return events_connectable(bound)


def is_loopback(endpoint: str) -> bool:
    """Reachable from this node only: loopback TCP, ipc:// or inproc://."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host.startswith("127.") or host in ("localhost", "[::1]")


def _host(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rpartition(":")[0]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _resolves(host: str) -> bool:
    """This node resolves the name ``host``."""
    try:
        socket.getaddrinfo(host, None)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def exchange(world: TensorParallel, cfg: CacheConfig, inbox: str | None, events: Mapping[str, str]
             ) -> tuple[list[str], list[tuple[str | None, str | None]]]:
    """Every replica's inbox endpoint and ``(events endpoint, replay endpoint)`` (None
    where it publishes none), in replica order, on every rank: one allgather over the
    job (collective). ``inbox``: this rank's inbox endpoint (TP rank 0 of a replica;
    None elsewhere); ``events``: its ``cache.stats()["events"]``. Raises ConfigError on
    every rank when a replica on another node than rank 0's (the router's) can be
    reached on its own node only, or when a host name announced (a wildcard bind's) does
    not resolve on some rank (then a second allgather, of what did not: ZMQ would
    retry such a connection silently, and the run would wait for it forever)."""
    mine = None
    if inbox is not None:
        pub = events.get("endpoint")
        replay = events.get("replay_endpoint")
        mine = (connectable(inbox), (None if pub is None else connectable(pub),
                                     None if replay is None else connectable(replay)))
    gathered = world.allgather((socket.gethostname(), mine), "the inboxes")
    router_node = gathered[0][0]  # rank 0's
    far = [(host, ep) for host, m in gathered if m is not None and host != router_node
           for ep in (m[0], *m[1]) if ep is not None and is_loopback(ep)]
    if far:
        raise ConfigError("cache.events.endpoint", cfg.cache.events.endpoint,
                          f"a replica on {far[0][0]} is reachable on its own node only ({far[0][1]}), "
                          f"and the router runs on {router_node}: turn cache.events on with an endpoint "
                          "other nodes reach, tcp://*:PORT or tcp://INTERFACE:PORT (README, 'Routing "
                          "across nodes')")
    leaders = [m for _, m in gathered if m is not None]
    names = {_host(ep) for m in leaders for ep in (m[0], *m[1]) if ep is not None and ep.startswith("tcp://")}
    if bind_host(cfg) in _WILDCARDS:  # the router's own endpoint, announced by rank 0's host name
        names.add(router_node)
    names = {h for h in names if not _is_address(h)}
    if names:  # the same set on every rank: every rank reaches this allgather, or none
        unresolved = world.allgather(sorted(h for h in names if not _resolves(h)), "the host names announced")
        bad = next(((rank, h) for rank, hosts in enumerate(unresolved) for h in hosts), None)
        if bad is not None:
            raise ConfigError("cache.events.endpoint", cfg.cache.events.endpoint,
                              f"rank {bad[0]} (on {gathered[bad[0]][0]}) cannot resolve the host name "
                              f"{bad[1]!r}, announced for a wildcard bind: make host names resolve between "
                              "the nodes, or bind one interface, tcp://INTERFACE:PORT (announced by its "
                              "address)")
    return [box for box, _ in leaders], [pubs for _, pubs in leaders]
