"""``cache.events``: vLLM's KVEventsConfig keys, off by default, loopback by default;
a mistake is one ConfigError naming the key and the value (one line, exit 2 at the
command line), also when the endpoint cannot be bound."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvdist
from kvdist.events.endpoints import connectable, offset_endpoint
from kvdist.testing import Seams, create
from tests.conftest import make_cfg

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_off_and_loopback():
    ev = kvdist.load_config(make_cfg()).cache.events
    assert (ev.enabled, ev.endpoint, ev.replay_endpoint, ev.topic, ev.buffer_steps) == \
        (False, "tcp://127.0.0.1:5557", None, "", 10_000)


@pytest.mark.parametrize("key,value,says", [
    ("endpoint", "http://127.0.0.1:5557", "tcp://HOST:PORT"),
    ("endpoint", "tcp://127.0.0.1:65536", "PORT 0..65535"),
    ("endpoint", "tcp://127.0.0.1", "tcp://HOST:PORT"),
    ("replay_endpoint", "udp://x:1", "tcp://HOST:PORT"),
    ("endpoint", "inproc://kv", "the publisher is a process of its own"),
    ("enabled", "yes", "boolean"),
    ("buffer_steps", 0, "greater than 0"),
    ("topic", 3, "string"),
    ("publisher", "zmq", "unknown key"),
])
def test_bad_values_name_the_key(key, value, says):
    with pytest.raises(kvdist.ConfigError) as ei:
        kvdist.load_config(make_cfg(cache={"events": {key: value}}))
    msg = str(ei.value)
    assert f"cache.events.{key}" in msg and repr(value) in msg and says in msg and "\n" not in msg


def test_the_replay_socket_needs_its_own_endpoint():
    with pytest.raises(kvdist.ConfigError, match="cache.events.replay_endpoint.*give the replay socket"):
        kvdist.load_config(make_cfg(cache={"events": {"enabled": True, "endpoint": "tcp://127.0.0.1:6000",
                                                      "replay_endpoint": "tcp://127.0.0.1:6000"}}))


def test_ports_are_offset_by_replica():
    assert offset_endpoint("tcp://127.0.0.1:5557", 0, "k") == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 3, "k") == "tcp://127.0.0.1:5560"
    assert offset_endpoint("tcp://*:5557", 1, "k") == "tcp://*:5558"
    assert offset_endpoint("tcp://127.0.0.1:0", 2, "k") == "tcp://127.0.0.1:0"  # any free port
    assert offset_endpoint("ipc:///tmp/kv", 2, "k") == "ipc:///tmp/kv_dp2"
    with pytest.raises(kvdist.ConfigError, match="cache.events.endpoint.*port 65537, past 65535"):
        offset_endpoint("tcp://127.0.0.1:65535", 2, "cache.events.endpoint")


def test_a_wildcard_bind_is_connected_to_by_this_host_name():
    host = socket.gethostname()
    for bound in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"):
        assert connectable(bound) == f"tcp://{host}:5557"
        assert connectable(connectable(bound)) == f"tcp://{host}:5557"
    for bound in ("tcp://127.0.0.1:5557", "tcp://10.0.0.5:6000", "tcp://[::1]:6000", "ipc:///tmp/kv_dp1"):
        assert connectable(bound) == bound


def _taken_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_an_endpoint_that_cannot_be_bound_fails_the_start_and_leaves_nothing():
    taken = _taken_port()
    port = taken.getsockname()[1]
    seams = Seams()
    try:
        with pytest.raises(kvdist.ConfigError) as ei:
            create(make_cfg(cache={"events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{port}"}}),
                   seams)
        assert "cache.events.endpoint" in str(ei.value) and f":{port}" in str(ei.value)
        assert "cannot bind it" in str(ei.value)
        rc = seams.rank_cache
        assert rc is None or (rc.manager is None and rc.events is None), "the candidate must be torn down"
    finally:
        taken.close()


def test_a_replay_endpoint_that_cannot_be_bound_frees_the_pub_socket():
    taken = _taken_port()
    port = taken.getsockname()[1]
    free = _taken_port()
    pub_port = free.getsockname()[1]
    free.close()
    try:
        cfg = make_cfg(cache={"events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{pub_port}",
                                         "replay_endpoint": f"tcp://127.0.0.1:{port}"}})
        with pytest.raises(kvdist.ConfigError, match="cache.events.replay_endpoint"):
            kvdist.create(cfg)
        # The PUB socket's port was released: a cache binds it now.
        ok = kvdist.create(make_cfg(cache={"events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{pub_port}"}}))
        assert ok.stats()["events"]["endpoint"] == f"tcp://127.0.0.1:{pub_port}"
        ok.close()
    finally:
        taken.close()


def test_the_command_line_says_one_line_and_exits_2(tmp_path):
    taken = _taken_port()
    port = taken.getsockname()[1]
    try:
        cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text(encoding="utf-8"))
        cfg["cache"]["events"] = {"enabled": True, "endpoint": f"tcp://127.0.0.1:{port}"}
        p = tmp_path / "ev.yaml"
        p.write_text(yaml.safe_dump(cfg), encoding="utf-8")
        r = subprocess.run([sys.executable, "-m", "kvdist", "run", "--config", str(p)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, encoding="utf-8")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, r.stderr
        assert len(lines) == 1 and "cache.events.endpoint" in lines[0] and str(port) in lines[0], r.stderr
    finally:
        taken.close()
