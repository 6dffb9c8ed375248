"""Settings: ``load_config`` turns a YAML file or a nested dict into a validated,
immutable :class:`CacheConfig`. Validation is pydantic's; every failure becomes one
:class:`~kvdist.errors.ConfigError` naming the dotted key and the bad value."""

from __future__ import annotations

__all__ = ["MOVED_KEYS", "CacheConfig", "CacheSection", "DiskTierConfig", "DistributedConfig",
           "EventsConfig", "GpuTierConfig", "HostTierConfig", "ModelConfig", "RemoteConfig", "WorkloadConfig",
           "load_config"]

import json
import os
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import xxhash
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from . import paths
from .dtypes import ITEMSIZE
from .errors import MISSING, ConfigError
from .units import GiB, parse_size


def _positive_size(value: object) -> int:
    n = parse_size(value)
    if n == 0:
        raise ValueError("must be greater than 0")
    return n


Size = Annotated[int, BeforeValidator(parse_size)]
PositiveSize = Annotated[int, BeforeValidator(_positive_size)]


class _Section(BaseModel):
    # No key means anything at infinity or NaN (an infinite rate or timeout is a hang).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class ModelConfig(_Section):
    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: str = "float16"

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in ITEMSIZE:
            raise ValueError(f"unknown dtype; one of {', '.join(ITEMSIZE)}")
        return v


class GpuTierConfig(_Section):
    blocks: int | None = Field(default=None, gt=0)
    bytes: PositiveSize | None = None
    memory_fraction: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> GpuTierConfig:
        given = [k for k in ("blocks", "bytes", "memory_fraction") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of blocks, bytes, memory_fraction")
        return self


class HostTierConfig(_Section):
    bytes: Size | Literal["auto"] = 0
    # Registration granularity: one huge cudaHostRegister stalls every process on the node.
    chunk_bytes: PositiveSize = GiB
    prefault_threads: int = Field(default=0, ge=0)  # 0: one per core, at most 16
    auto_memory_fraction: float = Field(default=0.5, gt=0, le=1)
    auto_gpu_ratio: float = Field(default=4.0, gt=0)
    # RLIMIT_MEMLOCK caps a pinned tier; false where the CUDA driver does not charge
    # registered memory to it (the limit then only misleads).
    check_memlock: bool = True
    huge_pages: bool = True  # madvise(MADV_HUGEPAGE): fewer faults and page-table entries

    @field_validator("bytes", mode="before")
    @classmethod
    def _size_or_auto(cls, v: object) -> object:
        return v if v == "auto" else parse_size(v)


class DiskTierConfig(_Section):
    bytes: Size = 0
    path: str | None = None  # a directory; "auto": the private per-user one (kvdist.paths)
    io_threads: int = Field(default=4, gt=0)
    o_direct: bool = False
    # Share of the host tier end_step keeps free by demoting its coldest blocks: an
    # offload then lands in a slot no disk write is still reading (no host wait).
    demote_ahead: float = Field(default=0.05, ge=0, lt=1)
    # An offload that finds the host slots demote_ahead freed still being written drops
    # the host tier's coldest block for room instead of waiting for the write: the disk
    # tier takes what the disk writes in time (false: every offload waits for its slot).
    # With no room kept ahead (demote_ahead a host tier's fraction below one block), the
    # host tier demotes as it must and the offloads wait. Off by default until measured on
    # a GPU (run --compare's all-tiers-dropping beside all-tiers).
    drop_behind: bool = False
    # Reads slower than this are made to wait (0: as fast as the disk goes): a drill for
    # a slow disk, e.g. to watch the onboard-or-recompute policy turn it down.
    max_read_bytes_per_s: Size = 0

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        return v if v in (None, paths.AUTO) else os.path.abspath(v)


_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})|ipc://\S+")


def _endpoint(v: str | None) -> str | None:
    # No inproc://: the events are published by a process of its own, which no socket of
    # another process can reach in-process.
    if v is not None and (not (m := _ENDPOINT.fullmatch(v)) or (m[2] is not None and int(m[2]) > 65535)):
        raise ValueError("must be tcp://HOST:PORT (PORT 0..65535; 0 = any free port) or ipc://PATH "
                         "(inproc:// cannot be reached: the publisher is a process of its own)")
    return v


Endpoint = Annotated[str, BeforeValidator(_endpoint)]


class EventsConfig(_Section):
    """KV cache events (vLLM's ``KVEventsConfig`` keys; docs/design.md, "KV cache events"):
    the blocks each tier stores and removes, published by TP rank 0 of every replica in
    vLLM's wire format over ZMQ. Ports are offset by the replica index. The default binds
    loopback only; another address (``tcp://*:5557``, ``tcp://10.0.0.5:5557``) is bound
    only when written here."""

    enabled: bool = False
    endpoint: Endpoint = "tcp://127.0.0.1:5557"  # the PUB socket
    replay_endpoint: Endpoint | None = None  # the ROUTER socket resending recent batches
    topic: str = ""
    buffer_steps: int = Field(default=10_000, gt=0)  # batches kept for replay (vLLM's key)


class CacheSection(_Section):
    tokens_per_block: int = Field(default=16, gt=0)
    device: str = "auto"
    # "external": the engine owns the paged KV tensors and the GPU prefix cache; kvdist
    # keeps the host and disk tiers behind kvdist.external (docs/design.md, "An
    # engine-owned GPU tier").
    gpu: GpuTierConfig | Literal["external"]
    host: HostTierConfig = HostTierConfig()
    disk: DiskTierConfig = DiskTierConfig()
    enable_reuse: bool = True
    offload_min_priority: int = Field(default=0, ge=0, le=100)
    # Onboard a host or disk hit only when its expected copy time (bytes / the tier's
    # measured bandwidth) is below the expected time to recompute it (measured prefill
    # rate, fed by the engine through KVCache.observe_prefill); docs/design.md, "Onboard or recompute".
    recompute_when_faster: bool = True
    simulate_async: bool = False
    # Copies between the GPU and the host tier go in this many groups of consecutive
    # layers, layer 0's first, each with its own event; compute waits for a group only
    # when it first reads one of its layers (kv_pool). 1: the whole step waits at
    # block_table. Clamped to model.num_layers. "auto": as many groups as keep every
    # piece (a group's slice of a block) at least min_copy_piece bytes: the copy engines
    # move smaller pieces slowly (H200, scripts/gpu/piece_probe.py: 256 KiB pieces
    # 54 GB/s one way and 90 both ways; 8 KiB pieces 4 GB/s).
    layer_groups: int | Literal["auto"] = "auto"
    min_copy_piece: PositiveSize = 256 * 1024
    events: EventsConfig = EventsConfig()

    @field_validator("layer_groups")
    @classmethod
    def _positive_groups(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be a positive int or 'auto'")
        return v

    @field_validator("gpu", mode="before")
    @classmethod
    def _sized_or_external(cls, v: object) -> object:
        if not isinstance(v, dict | GpuTierConfig) and v != "external":
            raise ValueError("give {blocks: N}, {bytes: SIZE}, {memory_fraction: F} or external")
        return v

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two")
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("unknown device; use auto, cpu, cuda or cuda:N")
        return v


class RemoteConfig(_Section):
    """The remote tier: a replica's misses looked up in the other replicas' host tiers
    (docs/design.md, "Remote tier"). Needs a host tier."""

    enabled: bool = False
    fetch_timeout_ms: float = Field(default=100.0, gt=0)
    # How bytes travel between replicas: auto = a shared mapping between replicas on one
    # node, MPI messages across nodes; "messages" everywhere (benchmarks, tests).
    transport: Literal["auto", "messages"] = "auto"
    # Host-tier changes go to the other replicas every this many steps, in one message
    # per peer (fewer, larger messages; the directory lags by as many steps).
    directory_every_steps: int = Field(default=8, ge=1)


def _seconds_or_auto(value: object) -> float | str:
    if value == "auto":
        return "auto"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
        return float(value)
    raise ValueError("must be seconds > 0, or auto")


StepTimeout = Annotated[float | str, BeforeValidator(_seconds_or_auto)]


class DistributedConfig(_Section):
    consensus_timeout_s: float = Field(default=120.0, gt=0)
    # Bound of every run-time collective (docs/design.md, "A stalled rank"): seconds, or
    # auto = max(10 s, 4 x the slowest interval between two collectives seen).
    step_timeout_s: StepTimeout = "auto"
    check_consistency_every: int = Field(default=0, ge=0)  # steps; 0 = never automatically
    tp_size: int = Field(default=0, ge=0)  # ranks per replica; 0 = the whole job is one replica
    remote: RemoteConfig = RemoteConfig()


def _token_range(value: object) -> tuple[int, int]:
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and 0 < value[0] <= value[1]):
        return (value[0], value[1])
    raise ValueError("must be [min, max]: two positive ints with min <= max")


TokenRange = Annotated[tuple[int, int], BeforeValidator(_token_range)]


class WorkloadConfig(_Section):
    """The synthetic serving trace and tiny model of ``python -m kvdist run`` (ignored by
    the cache). Ranges are ``[min, max]``, drawn uniformly."""

    requests: int = Field(default=400, gt=0)
    seed: int = Field(default=0, ge=0, lt=1 << 63)  # numpy's and torch's generators take 0..2**63-1 here
    system_prompts: int = Field(default=4, gt=0)
    system_prompt_tokens: int = Field(default=256, gt=0)
    conversations: int = Field(default=64, gt=0)  # chats alive at once (the working set)
    turns: TokenRange = (1, 8)  # requests per chat; each resends the whole history
    user_tokens: TokenRange = (16, 96)
    output_tokens: TokenRange = (8, 32)
    # Requests per step (Poisson). Above a million, every trace arrives in its first steps
    # anyway; below 0.001 the run would be idle steps (a thousand per request).
    arrival_rate: float = Field(default=4.0, ge=1e-3, le=1e6)
    think_steps: int = Field(default=0, ge=0)  # a chat's next turn comes >= this after its reply
    routing: Literal["round_robin", "sticky", "prefix"] = "round_robin"  # requests -> replicas
    # Several replicas keep the trace's time by the wall clock, one step per step_ms, so
    # they all see the same moment (a chat's next turn on one, its reply on another).
    step_ms: float = Field(default=10.0, gt=0)
    max_batch: int = Field(default=16, gt=0)  # sequences per step (prefills + decodes)
    max_prefill_tokens: int = Field(default=2048, gt=0)  # prompt tokens admitted per step
    priority: int = Field(default=35, ge=0, le=100)
    vocab_size: int = Field(default=512, gt=1, le=1 << 20)  # the model keeps vocab x hidden weights
    hidden: int = Field(default=64, gt=0, le=8192)  # the model's width
    q_per_kv: int = Field(default=1, gt=0)  # query heads per K/V head (grouped-query attention)
    ffn_hidden: int = Field(default=0, ge=0)  # SwiGLU MLP width (global); 0 = 4 x hidden
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA
    # A CUDA model on one rank replays each step's per-token work from CUDA graphs.
    cuda_graphs: bool = True
    # The main job prepares step N+1 while step N's forward pass runs; None: on CUDA.
    run_ahead: bool | None = None
    # true: a request whose prefix must come from disk waits for its prefetch's reads
    # (agreed by the ranks), so no step blocks on them; false: it is admitted at once and
    # the host waits for the reads when the step needs them. False by default: on the
    # H200 capacity run it gave more tokens per second and less GPU idle (README).
    wait_for_disk_reads: bool = False
    # Open-loop arrivals in wall-clock time for `run --compare` (requests per second).
    request_rate: float = Field(default=2.0, gt=0)
    # The prefix-aware router's weight of the prefill blocks a replica would compute
    # against its active blocks (NVIDIA Dynamo's kv-overlap-score-weight; run --compare
    # of replicas).
    router_overlap_weight: float = Field(default=1.0, ge=0)
    verify_logits_every: int = Field(default=25, ge=0)  # requests with reuse; 0 = never


class CacheConfig(_Section):
    """The whole validated config. Immutable; ``digest()`` is equal on ranks whose
    normalized configs are equal."""

    model: ModelConfig
    cache: CacheSection
    distributed: DistributedConfig = DistributedConfig()
    workload: WorkloadConfig = WorkloadConfig()

    def normalized(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def digest(self) -> str:
        text = json.dumps(self.normalized(), sort_keys=True)
        return xxhash.xxh3_128_hexdigest(text.encode())

    def replace(self, **sections: dict[str, Any]) -> CacheConfig:
        """A copy with some keys changed, e.g. ``cfg.replace(cache={"host": {"bytes": 0}})``."""
        return load_config(_merge(self.normalized(), sections))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _to_config_error(err: ValidationError) -> ConfigError:
    e = err.errors()[0]
    # A union's member appears in the location as a tag (cache.gpu's "function-after[...]"):
    # the key is the config's own path.
    key = ".".join(str(p) for p in e["loc"] if "[" not in str(p)) or "<config>"
    kind = e["type"]
    if kind == "extra_forbidden":
        return ConfigError(key, e["input"], "unknown key")
    if kind == "missing":
        return ConfigError(key, MISSING, "missing required key")
    msg = e["msg"].removeprefix("Value error, ")
    return ConfigError(key, e.get("input"), msg)


# Keys that moved: the old key is still read, with a FutureWarning, into the new one;
# giving both with different values is a ConfigError.
MOVED_KEYS = {("workload", "check_consistency_every"): ("distributed", "check_consistency_every")}


def _move_old_keys(data: dict) -> dict:
    for (section, key), (new_section, new_key) in MOVED_KEYS.items():
        old = data.get(section)
        new = data.get(new_section, {})
        if not isinstance(old, dict) or key not in old or not isinstance(new, dict):
            continue
        value = old[key]
        if new_key in new and new[new_key] != value:
            raise ConfigError(f"{section}.{key}", value, f"replaced by {new_section}.{new_key}, which "
                              f"is {new[new_key]!r}: give only {new_section}.{new_key}")
        warnings.warn(f"kvdist config: {section}.{key} is deprecated, read as {new_section}.{new_key}",
                      FutureWarning, stacklevel=3)
        data = {**data, section: {k: v for k, v in old.items() if k != key},
                new_section: {**new, new_key: value}}
    return data


def load_config(source: str | os.PathLike | dict | CacheConfig) -> CacheConfig:
    """Validate a config given as a YAML path, a nested dict or a CacheConfig.

    Raises ConfigError naming the first bad key and its value."""
    if isinstance(source, CacheConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError("<file>", str(path), f"cannot read the config file: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError("<file>", str(path), "not a YAML config: the file is not UTF-8 text") from None
        except yaml.YAMLError as e:
            raise ConfigError("<file>", str(path), f"not valid YAML: {e}".replace("\n", " ")) from None
        if data is None:
            data = {}
    else:
        data = source
    if not isinstance(data, dict):
        raise ConfigError("<config>", type(data).__name__, "the config must be a mapping")
    data = _move_old_keys(data)
    try:
        cfg = CacheConfig.model_validate(data)
    except ValidationError as err:
        raise _to_config_error(err) from None
    if cfg.distributed.remote.enabled and cfg.cache.host.bytes == 0:
        raise ConfigError("distributed.remote.enabled", True,
                          "the remote tier needs a host tier (cache.host.bytes > 0)")
    if cfg.cache.gpu == "external":
        _check_external(cfg)
    _check_disk_dir(cfg.cache.disk)
    ev = cfg.cache.events
    if ev.enabled and ev.replay_endpoint == ev.endpoint and not ev.endpoint.endswith(":0"):
        raise ConfigError("cache.events.replay_endpoint", ev.replay_endpoint,
                          "the same as cache.events.endpoint: give the replay socket its own")
    return cfg


def _check_external(cfg: CacheConfig) -> None:
    """``cache.gpu: external``: the engine's scheduler plans host and disk slots from
    the config alone (kvdist.external.ExternalPlanner), so their sizes must be given, and
    there must be a tier for kvdist to keep."""
    c = cfg.cache
    if c.host.bytes == "auto":
        raise ConfigError("cache.host.bytes", "auto", "with cache.gpu: external give a size: the engine's "
                          "scheduler plans host slots from the config")
    if c.host.bytes == 0 and not (c.disk.bytes and c.disk.path):
        raise ConfigError("cache.gpu", "external", "needs a host or disk tier (cache.host.bytes or "
                          "cache.disk.bytes with cache.disk.path) for kvdist to keep")
    if c.events.enabled:
        raise ConfigError("cache.events.enabled", True, "kvdist publishes no KV cache events with "
                          "cache.gpu: external yet (the engine publishes its own)")


def _check_disk_dir(disk: DiskTierConfig) -> None:
    """The disk tier's directory can hold a file of ``bytes`` (one rank's share; the
    start checks the node's ranks together). Runs after every other key validated
    and creates nothing: the directory is made when the tier is built. Space this
    process's open disk tiers hold there counts as free: a copy of the config made
    while the cache runs (``replace``) must not refuse the tier it already has."""
    if not disk.bytes or disk.path is None:
        return
    directory = paths.resolve_disk_dir(disk.path)
    problem = paths.files_problem(directory)
    if problem is not None:
        raise ConfigError("cache.disk.path", disk.path, problem)
    free = paths.free_bytes(directory) + paths.reserved_bytes(directory)
    if disk.bytes > free:
        raise ConfigError("cache.disk.bytes", disk.bytes,
                          f"more than the {free:,} bytes free under {paths.nearest_existing(directory)}")
