"""Where one replica's events are published: ``cache.events``' endpoints, the port
moved up by the replica index. The one place that resolves them (the cache's
publisher and a router placing its subscriptions both call :func:`replica_endpoints`)."""

from __future__ import annotations

from ..config import EventsConfig
from ..errors import ConfigError

__all__ = ["offset_endpoint", "replica_endpoints"]


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
