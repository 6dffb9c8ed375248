"""A request as the engine serves it: a prompt, the reply it decodes (scripted by the
trace: the simulated model decodes exactly these tokens, so no placeholder token is
ever needed), when it arrives, and the turn it follows. The experiment's trace
(``kvdist.sim.experiment.workload``) makes them; the engine reads nothing else of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["Request", "RequestSource"]


@dataclass(slots=True)
class Request:
    rid: int
    chat: int  # chat id; every chat starts with one of the system prompts
    turn: int  # 0 for the chat's first request
    arrival: int  # scheduler step at which the request arrives
    prompt: np.ndarray  # int32 token ids: system prompt, history, new user message
    output: np.ndarray  # int32: the reply the model decodes (scripted)
    after: int  # rid of the chat's previous turn (must finish first), -1 for turn 0
    arrival_s: float = 0.0  # wall-clock arrival in seconds from the start (runs in real time)

    def blocks_needed(self, tokens_per_block: int) -> int:
        """GPU blocks the request holds at its largest: the prompt plus every decoded
        token whose K/V is written (all but the last reply token)."""
        return -(-(len(self.prompt) + len(self.output) - 1) // tokens_per_block)


class RequestSource(Protocol):
    """What the scheduler serves: its requests in arrival order (the trace, or a
    replica's share of it)."""

    @property
    def requests(self) -> Sequence[Request]: ...

