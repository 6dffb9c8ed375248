"""The remote tier's rules as one frozen value, read when the tier is built (docs/design.md,
"Remote tier"). Every rule is on in a cache built by ``kvdist.create``; tests switch
one off by name (``Seams(remote_rules=REMOTE_RULES - {"R2"})``) to show what it
prevents. R3 (no coupling between replicas) is how the tier is built, not a switch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REMOTE_RULES", "RemoteRules"]

REMOTE_RULES = frozenset({"R1", "R2", "R4"})  # the rules that can be switched off, all on by default


@dataclass(frozen=True, slots=True)
class RemoteRules:
    agree_outcomes: bool = True  # R1: a block lands once every TP rank has it whole
    check_stamps: bool = True  # R2: stamps read around every copy out of a peer's slot
    agree_directory: bool = True  # R4: the TP group applies the directory prefix all have

    @classmethod
    def named(cls, names: frozenset[str] = REMOTE_RULES) -> RemoteRules:
        """The rules of these names on, the others off."""
        unknown = set(names) - REMOTE_RULES
        assert not unknown, f"unknown remote rules {sorted(unknown)}: the rules are {sorted(REMOTE_RULES)}"
        return cls(agree_outcomes="R1" in names, check_stamps="R2" in names, agree_directory="R4" in names)
