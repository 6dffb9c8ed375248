"""The one definition of how a rank's watcher and the launcher talk: the environment
names the launcher sets for the ranks, and the lines a watcher sends over its TCP
connection. Standard library only and no package import: the watcher loads this file
on its own (``python -E -s -S kvdist/launcher/rank_watcher.py``) in milliseconds.

Over one connection, watcher -> launcher, one line each, ASCII:

    hello   RANK HOST PID TOKEN   at once (the token proves it is this job's watcher)
    end                           the moment the rank's process ends
    status  S | -                 its wait status (0..65535), or ``-`` where it cannot be had

Launcher -> watcher, only one line, before it closes a connection it does not take (a
bad or late hello, too many waiting): ``refused``. Otherwise the launcher closes the
connection when the job is over; a watcher that sees its connection close without
``refused`` while its rank still runs takes it as the launcher's death and stops the
rank. Anything else a peer sends is a bad line: the launcher counts it and ignores it
(a bad hello closes that connection)."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

__all__ = ["ADDR_ENV", "END", "MAX_LINE", "REFUSED", "TOKEN_ENV", "Hello", "hello", "parse_hello",
           "parse_status", "status"]

ADDR_ENV = "KVDIST_LAUNCH_ADDR"  # where the watchers report: ADDRESS:PORT ([v6]:PORT)
TOKEN_ENV = "KVDIST_LAUNCH_TOKEN"  # the job's secret; never on a command line
MAX_LINE = 512  # a longer line is garbage
END = b"end\n"
REFUSED = b"refused\n"

_HELLO = re.compile(r"hello ([0-9]{1,7}) ([A-Za-z0-9._:-]{1,255}) ([0-9]{1,10}) ([0-9a-f]{1,128})", re.ASCII)
_STATUS = re.compile(r"status (?:([0-9]{1,5})|-)", re.ASCII)


@dataclass(frozen=True, slots=True)
class Hello:
    rank: int
    host: str
    pid: int


def hello(token: str, rank: int, host: str, pid: int) -> bytes:
    """The hello line; a host name's characters outside the protocol's become ``_``."""
    host = re.sub(r"[^A-Za-z0-9._:-]", "_", host)[:255] or "_"
    return f"hello {rank} {host} {pid} {token}\n".encode()


def status(wait_status: int | None) -> bytes:
    return f"status {'-' if wait_status is None else wait_status}\n".encode()


def parse_hello(line: bytes, token: str, np: int) -> Hello | None:
    """The hello of a watcher of rank < ``np`` with the job's ``token``; None for
    anything else."""
    m = _HELLO.fullmatch(line.decode("ascii", "replace"))
    if m is None or not hmac.compare_digest(m[4], token):
        return None
    rank, pid = int(m[1]), int(m[3])
    return Hello(rank, m[2], pid) if rank < np and pid > 0 else None


def parse_status(line: bytes) -> tuple[bool, int | None]:
    """(whether ``line`` is a status line, the wait status it gives or None)."""
    m = _STATUS.fullmatch(line.decode("ascii", "replace"))
    if m is None:
        return False, None
    if m[1] is None:
        return True, None
    value = int(m[1])
    return (True, value) if value <= 0xFFFF else (False, None)
