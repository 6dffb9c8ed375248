"""Error types of kvdist. Every error the library raises on purpose derives from
:class:`KVDistError`, so an engine can catch the whole family in one clause."""

from __future__ import annotations

__all__ = ["CacheClosedError", "ConfigError", "ConsensusAbort", "ConsensusTimeout", "ConsistencyError",
           "CollectiveMismatch", "HostTierUnavailable", "KVDistError", "OutOfBlocksError", "PeerFailed",
           "RankStalled", "StepOrderError"]


class KVDistError(Exception):
    """Base class of every kvdist error."""


MISSING = object()


class ConfigError(KVDistError, ValueError):
    """A config key or value is wrong. The message names the key and the value. A key
    that starts with ``--`` is a command-line option, an upper-case one an environment
    variable."""

    def __init__(self, key: str, value: object, problem: str):
        self.key = key
        self.value = value
        self.problem = problem
        got = "" if value is MISSING else f" (got {value!r})"
        what = ("option" if key.startswith("--") else
                "environment variable" if key.isupper() else "config key")
        super().__init__(f"{what} '{key}': {problem}{got}")


class OutOfBlocksError(KVDistError):
    """A sequence cannot fit in the GPU tier even after evicting every evictable block."""

    def __init__(self, needed: int, available: int, what: str = "sequence"):
        self.needed = needed
        self.available = available
        super().__init__(
            f"{what} needs {needed} GPU blocks but only {available} can be had "
            f"(free + evictable); release sequences or enlarge cache.gpu"
        )


class HostTierUnavailable(KVDistError):
    """The pinned host tier cannot be had (pinning, registration, ENOMEM, memlock).

    In a multi-rank start this means USE_NO_HOST, not ABORT."""


class ConsensusAbort(KVDistError):
    """The ranks agreed to abort the start. ``failures`` maps rank -> reason for every
    rank that failed."""

    def __init__(self, message: str, failures: dict[int, str]):
        self.failures = dict(failures)
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
        super().__init__(f"{message}: {detail}" if detail else message)


class ConsensusTimeout(KVDistError):
    """A collective did not complete within ``distributed.consensus_timeout_s``:
    at least one rank never arrived."""


class RankStalled(ConsensusTimeout):
    """A run-time collective did not complete within ``distributed.step_timeout_s``;
    ``stalled`` maps the world rank of every rank that did not arrive to one line naming
    it (node, pid, the collective), ``line`` is what the job prints."""

    def __init__(self, line: str, stalled: dict[int, str]):
        self.line = line
        self.stalled = dict(stalled)
        super().__init__(line)


class PeerFailed(KVDistError):
    """One rank's part of a run's set-up failed after the run-time collectives began
    (its peers were already on their way to the first step): that rank told every
    other, and every rank raises this at once. ``rank`` is the failing rank (world
    numbering), ``exit_code`` the job's (2 for a config error, else 1)."""

    def __init__(self, line: str, rank: int, exit_code: int = 1):
        self.line = line
        self.rank = rank
        self.exit_code = exit_code
        super().__init__(line)


class CollectiveMismatch(KVDistError):
    """The ranks of a communicator entered different collectives (a call made on some
    ranks only): ``calls`` maps each rank of the communicator to the call it made."""

    def __init__(self, message: str, calls: dict[int, str]):
        self.calls = dict(calls)
        super().__init__(message)


class ConsistencyError(KVDistError):
    """Ranks that must hold identical cache state have diverged."""

    def __init__(self, message: str, diverged: list[int]):
        self.diverged = list(diverged)
        super().__init__(message)


class CacheClosedError(KVDistError):
    """A call on a cache after its ``close()``."""


class StepOrderError(KVDistError):
    """A step call out of order: ``begin_step`` while a step is open, ``end_step`` or
    a scheduling call (``add_sequence``, ``append_tokens``, ``block_table``) outside one."""
