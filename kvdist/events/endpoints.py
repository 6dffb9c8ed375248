"""Where one replica's events are published: ``cache.events``' endpoints, the port
moved up by the replica index, and the endpoint a subscriber elsewhere connects to. The
one place that resolves them (the cache's publisher calls :func:`replica_endpoints`; a
router placing its subscriptions calls :func:`connectable` on what a replica bound)."""

from __future__ import annotations

import socket

from ..config import EventsConfig
from ..errors import ConfigError

__all__ = ["connectable", "offset_endpoint", "replica_endpoints"]

_WILDCARDS = ("*", "0.0.0.0", "[::]", "[::0]", "::", "[0:0:0:0:0:0:0:0]")


def offset_endpoint(endpoint: str, replica: int, key: str) -> str:
    """``endpoint`` for ``replica``: a TCP port moved up by the replica index (port 0,
    any free port, stays), an ipc/inproc name suffixed ``_dp<replica>`` (vLLM's rule)."""
    if replica == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{replica}"
    host, _, port = endpoint.rpartition(":")
    if int(port) == 0:
        return endpoint
    if int(port) + replica > 65535:
        raise ConfigError(key, endpoint, f"replica {replica} would publish on port {int(port) + replica}, "
                                         "past 65535: give a lower port")
    return f"{host}:{int(port) + replica}"


def replica_endpoints(cfg: EventsConfig, replica: int) -> tuple[str, str | None]:
    """The PUB and replay endpoints replica ``replica`` binds (replay: None without one)."""
    replay = cfg.replay_endpoint
    return (offset_endpoint(cfg.endpoint, replica, "cache.events.endpoint"),
            None if replay is None else offset_endpoint(replay, replica, "cache.events.replay_endpoint"))


def connectable(bound: str) -> str:
    """The endpoint subscribers connect to, from the one bound (``stats()["events"]``'s
    ``endpoint``): a TCP wildcard host (``*``, ``0.0.0.0``, ``[::]``) becomes this host's
    name (``socket.gethostname()``, resolved by the subscriber as MPI's host names are);
    anything else is returned as it is (idempotent)."""
    if not bound.startswith("tcp://"):
        return bound
    host, sep, port = bound[len("tcp://"):].rpartition(":")
    if sep and host in _WILDCARDS:
        return f"tcp://{socket.gethostname()}:{port}"
    return bound
