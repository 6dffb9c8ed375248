"""A sequence as the manager holds it (its tokens and the GPU slot of each block) and
token ids as the cache takes them (``token_array``)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["Sequence", "token_array"]


def token_array(tokens: Iterable[int]) -> array:
    """Token ids as an int32 array, converted whole before anything changes. Ids are
    opaque to the cache (hashed, never indexed): any int32 is accepted, negative ones
    included, and a bool is the int it equals (Python's ``True == 1``). Anything else
    (a float, a str, an id outside int32) raises ValueError. An int32 array is copied."""
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens[:]
    if not isinstance(tokens, list | tuple):
        tokens = list(tokens)  # a generator that raises midway raises here
    tok = array("i")
    try:  # struct converts a list of ints 2.5x faster than array() does
        tok.frombytes(struct.pack(f"{len(tokens)}i", *tokens))
    except struct.error as e:
        raise ValueError(f"token ids must be ints that fit in int32 ({e})") from None
    return tok


@dataclass(slots=True)
class Sequence:
    seq_id: Hashable
    tokens: array  # int32 token ids known to the cache
    slots: list[int]  # GPU slot of each block, in order
    priority: int
    num_hashed: int  # leading full blocks whose hashes are written into their slots' meta
    parent: bytes  # digest of block num_hashed - 1 (the salt when 0)
    num_indexed: int = 0  # leading full blocks registered (indexed, or found duplicate)
