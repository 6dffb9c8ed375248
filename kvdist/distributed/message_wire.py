"""The message transport's wire format, one definition for both sides (the fetcher,
``message_transport``; the holder, ``message_server``), on the cross-replica
communicator:

* a request, tag ``REQUEST_TAG``: int64 ``[id, n, slots × n, hash hi × n, hash lo × n]``;
* the answer, one message per block (the slot's bytes) on the request's data tag, in
  request order (MPI keeps one sender's messages of one tag in order);
* then the trailer on the request's trailer tag: the id (8 bytes), then one byte per
  block, 1 where the holder's stamps vouched for it before and after the send (R2).

Every request has its own tags (derived from its id), so an answer can only match the
receives posted for it; the fetcher still lands nothing unless the trailer carries
its request's id (``trailer_verdict``)."""

from __future__ import annotations

import numpy as np

__all__ = ["REQUEST_TAG", "decode_request", "encode_request", "encode_trailer", "tags", "trailer_verdict"]

REQUEST_TAG = 12
_ANSWER_BASE = 1 << 20  # answer tags: base + 2 * (id mod 2**26) (+1 for the trailer)
_ID_SPAN = 1 << 26


def tags(rid: int) -> tuple[int, int]:
    """(data tag, trailer tag) of request ``rid``."""
    t = _ANSWER_BASE + 2 * (rid % _ID_SPAN)
    return t, t + 1


def encode_request(rid: int, slots: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return np.concatenate(([rid, len(slots)], slots, hi.view(np.int64), lo.view(np.int64))).astype(np.int64)


def decode_request(buf: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(id, slots, hash hi, hash lo) of a request buffer."""
    rid, n = int(buf[0]), int(buf[1])
    return (rid, buf[2:2 + n], buf[2 + n:2 + 2 * n].view(np.uint64),
            buf[2 + 2 * n:2 + 3 * n].view(np.uint64))


def trailer_size(n: int) -> int:
    return 8 + n


def encode_trailer(rid: int, good: np.ndarray) -> np.ndarray:
    return np.concatenate((np.array([rid], dtype=np.int64).view(np.uint8), good.astype(np.uint8)))


def trailer_verdict(trailer: np.ndarray, rid: int) -> np.ndarray:
    """Per block, good: the trailer says so and answers request ``rid`` (else none is)."""
    if int(trailer[:8].view(np.int64)[0]) != rid:
        return np.zeros(len(trailer) - 8, dtype=bool)
    return trailer[8:].astype(bool)
