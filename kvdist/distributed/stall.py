"""Run-time deadlines, and naming the rank a collective waits for.

Start-up collectives are bounded by ``distributed.consensus_timeout_s``; once a cache
(or the main job's model) runs, every collective of :class:`~kvdist.distributed.comm.MpiComm`
is bounded by a :class:`Pace` instead (``distributed.step_timeout_s``): a fixed number of
seconds, or ``auto`` = ``max(FLOOR_S, FACTOR x the slowest interval between two
completed collectives of that communicator)`` — a few times the slowest step seen.

When a deadline passes, the ranks learn *which* rank did not arrive without another
collective (that rank would not join it): every run-time communicator has a
:class:`Watch`, a Dup of it that carries small point-to-point messages. The rank whose
deadline passed sends its status (the collective it waits in, for how long) to every
peer; a rank waiting in any bounded collective polls every watch of its process and
answers with its own; after ``GRACE_S`` the peers not heard from are the stalled ones,
named with the node and pid every rank gave at start. A peer heard from but waiting in
another collective means the ranks called different collectives. Either way every rank
raises (:class:`~kvdist.errors.RankStalled` or
:class:`~kvdist.errors.CollectiveMismatch`), tells the peers of its other watches (the
job's other replicas learn it by message, never by a collective: rule R3), and every
later bounded collective of the process raises the same error at once. A rank whose
own part of a run's set-up fails (``fail_alone``) ends the job the same way: its peers
raise :class:`~kvdist.errors.PeerFailed` at once instead of waiting out the first
step's deadline for it."""

from __future__ import annotations

__all__ = ["FACTOR", "FLOOR_S", "GRACE_S", "Pace", "Peer", "Watch", "ended", "expired", "fail_alone", "poll"]

import time
from dataclasses import dataclass

from ..errors import CollectiveMismatch, ConfigError, KVDistError, PeerFailed, RankStalled

FLOOR_S = 10.0  # auto: never less than this
FACTOR = 4.0  # auto: this many times the slowest interval between collectives seen
GRACE_S = 1.0  # how long the ranks that arrived wait to hear from each other
_SAME_S = 0.05  # ranks whose waits differ by less came at the same time (naming the late one)
_STATUS, _ENDED, _NOTICE = 0x5A1, 0x5A2, 0x5A3  # message tags on a watch

_watches: list[Watch] = []  # the process's live watches
_ended: list[KVDistError] = []  # the stall (or mismatch) this process learned of
_kept: list[object] = []  # send requests and Dups MPI may still use


@dataclass(frozen=True, slots=True)
class Peer:
    """Who a rank of a communicator is, for naming it: its world rank, node and pid."""

    rank: int
    host: str
    pid: int

    def name(self) -> str:
        return f"rank {self.rank} (node {self.host}, pid {self.pid})"


class Pace:
    """The deadline of a run-time collective (``distributed.step_timeout_s``): ``fixed``
    seconds, or (None, ``auto``) max(FLOOR_S, FACTOR x the slowest interval between two
    completed collectives). Until the first collective has completed, ``warm_up_s``
    (the start-up bound): the ranks reach it after set-up work of their own (a model
    built, a report's header), not after a step."""

    def __init__(self, fixed: float | None, warm_up_s: float):
        self.fixed = fixed
        self.warm_up_s = warm_up_s
        self.slowest = 0.0
        self._last: float | None = None  # when the last collective completed

    def timeout_s(self) -> float:
        if self._last is None:
            return max(self.warm_up_s, self.fixed or FLOOR_S)
        return self.fixed if self.fixed is not None else max(FLOOR_S, FACTOR * self.slowest)

    def completed(self) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.slowest = max(self.slowest, now - self._last)
        self._last = now

    def setting(self) -> str:
        if self._last is None:
            return f"the first one after start-up: distributed.consensus_timeout_s: {self.warm_up_s:g} s"
        if self.fixed is not None:
            return f"distributed.step_timeout_s: {self.fixed:g} s"
        return (f"distributed.step_timeout_s: auto = max({FLOOR_S:g} s, {FACTOR:g} x the slowest "
                f"step seen, {self.slowest:.2f} s)")


class Watch:
    """A Dup of a run-time communicator for the messages of a stall (see the module
    docstring); ``peers[r]`` names rank r of the communicator."""

    def __init__(self, dup, peers: list[Peer], me: int):
        from mpi4py import MPI

        self.MPI = MPI
        self.mpi = dup
        self.peers = peers
        self.me = me
        self.notices: list[object] = []  # what peers posted with notify_all, oldest first
        _watches.append(self)

    def send_all(self, tag: int, obj: object) -> None:
        for r in range(len(self.peers)):
            if r != self.me:
                _kept.append(self.mpi.isend(obj, dest=r, tag=tag))  # never waited for

    def receive(self, tag: int) -> list:
        got, status = [], self.MPI.Status()
        while self.mpi.iprobe(source=self.MPI.ANY_SOURCE, tag=tag, status=status):
            got.append(self.mpi.recv(source=status.Get_source(), tag=tag))
        return got

    def notify_all(self, obj: object) -> None:
        """Post ``obj`` to every peer (point to point, not waited for); they find it in
        ``take_notices``."""
        self.send_all(_NOTICE, obj)

    def take_notices(self) -> list:
        got = self.notices + self.receive(_NOTICE)
        self.notices = []
        return got

    def peek_notices(self) -> list:
        self.notices += self.receive(_NOTICE)
        return list(self.notices)

    def close(self) -> None:
        if self in _watches:
            _watches.remove(self)
        if _ended:  # messages may still be under way on it
            _kept.append(self.mpi)
        else:
            self.mpi.Free()


def ended() -> KVDistError | None:
    """The stall or mismatch this process learned of (None: none)."""
    return _ended[0] if _ended else None


def _end(error: KVDistError, origin: Watch | None) -> KVDistError:
    """Record ``error`` for the process and tell the peers of every watch (a rank that
    arrives late learns the verdict rather than starting an exchange of its own)."""
    if not _ended:
        _ended.append(error)
        for w in _watches:
            if w is not origin or isinstance(error, RankStalled):
                w.send_all(_ENDED, (type(error).__name__, str(error), _detail(error)))
    return _ended[0]


def _detail(error: KVDistError) -> dict:
    if isinstance(error, PeerFailed):
        return {"rank": error.rank, "exit_code": error.exit_code}
    return error.stalled if isinstance(error, RankStalled) else getattr(error, "calls", {})


def fail_alone(error: BaseException, what: str, rank: int) -> None:
    """This rank (``rank`` of the job; its world rank where a watch knows it) failed,
    maybe on its own, in ``what`` (``error``, which it raises), while its peers may be
    on their way to a run-time collective it will never join: record it for the
    process (``ended``: a :class:`PeerFailed` naming this rank and ``error``) and tell
    the peers of every watch, whose bounded collectives then raise that PeerFailed at
    once (and every later one, as after a stall). Nothing when the process knew a
    verdict already; nobody is told without a run-time communicator (a job without
    MPI)."""
    if _ended:
        return
    if _watches:
        w = _watches[0]
        rank = w.peers[w.me].rank
    line = f"rank {rank} failed in {what}: {error if str(error) else repr(error)}"
    _end(PeerFailed(line, rank, 2 if isinstance(error, ConfigError) else 1), None)


def poll(what: str, since: float, mine: Watch | None = None) -> None:
    """Called while waiting in a bounded collective (of the communicator whose watch is
    ``mine``): raise when a peer ended the job or reports a stall (after answering it
    and hearing the others)."""
    if _ended:
        raise _ended[0]
    for w in list(_watches):
        verdict = _verdict(w)
        if verdict is not None:
            raise verdict
        heard = w.receive(_STATUS)
        if heard:
            elsewhere = mine is not None and w is not mine
            raise _settle(w, what, time.monotonic() - since, {s["rank"]: s for s in heard},
                          elsewhere=elsewhere)


def _verdict(w: Watch) -> KVDistError | None:
    """The verdict a peer of ``w`` reached and sent (recorded for the process), if any."""
    for kind, line, detail in w.receive(_ENDED):
        if kind == "PeerFailed":
            error: KVDistError = PeerFailed(line, detail["rank"], detail["exit_code"])
        else:
            error = RankStalled(line, detail) if kind == "RankStalled" else CollectiveMismatch(line, detail)
        return _end(error, w)
    return None


def expired(watch: Watch, what: str, waited: float, setting: str) -> KVDistError:
    """The deadline of ``what`` passed on this rank: the error to raise (every rank of
    the watch raises its own, naming the same ranks). A verdict the peers reached
    already comes first: a rank stopped past its deadline and resumed (a SIGCONT before
    the job's end) must not name the peers that left without it."""
    for w in list(_watches):
        verdict = _verdict(w)
        if verdict is not None:
            return verdict
    return _settle(watch, what, waited, {}, setting)


def _settle(w: Watch, what: str, waited: float, heard: dict[int, dict],
            setting: str | None = None, elsewhere: bool = False) -> KVDistError:
    """Tell the peers this rank's status, hear theirs for up to GRACE_S, and name the
    ranks not heard from (``setting``: the bound that passed; a rank answering a peer's
    report takes the peer's).

    ``elsewhere``: this rank waits in a collective of another communicator (a TP
    group's while the job's model waits in its own). It is alive, so its peers here
    count it as heard, but its collective is not theirs: neither a mismatch nor the
    collective a stalled rank is named for. While it hears its peers it answers the
    reports of its other watches the same way, and a verdict a peer reached meanwhile
    (on any watch) is taken as it is: a rank that waits in a group's collective for a
    stopped rank must not be named by the job's ranks for not answering them."""
    mine = {"rank": w.me, "what": what, "waited": waited, "setting": setting, "elsewhere": elsewhere}
    w.send_all(_STATUS, mine)
    end = time.monotonic() + GRACE_S
    everyone = set(range(len(w.peers))) - {w.me}
    answered: set[int] = set()
    # Until every peer is heard (or the grace ends); when every peer is, until the grace
    # ends for a verdict: a rank that is late, or in another collective, takes the
    # peers' verdict rather than one of its own (their reports may come before it).
    while time.monotonic() < end:
        for v in list(_watches):
            verdict = _verdict(v)
            if verdict is not None:
                return verdict
            if v is w:
                for s in w.receive(_STATUS):
                    heard[s["rank"]] = s
                for notice in w.receive(_NOTICE):
                    w.notices.append(notice)
            elif v.receive(_STATUS) and id(v) not in answered:
                answered.add(id(v))
                v.send_all(_STATUS, {"rank": v.me, "what": what, "waited": waited, "setting": None,
                                     "elsewhere": True})
        if everyone <= heard.keys() and _all_here(heard, what, elsewhere):
            break
        time.sleep(0.002)
    missing = sorted(everyone - heard.keys())
    me = w.peers[w.me].rank
    here = {r: s for r, s in heard.items() if not s.get("elsewhere")}  # waiting in this communicator
    if not missing and _all_here(heard, what, elsewhere):
        # Every rank is in this collective now, the last after a deadline passed: the
        # late one is the rank that waited least (the same figures on every rank).
        arrived = {w.me: waited} | {r: s["waited"] for r, s in heard.items()}
        least = min(arrived.values())
        missing = sorted(r for r, t in arrived.items() if t <= least + _SAME_S)
    if missing:
        # Named by the collective of this communicator the longest waiter waits in.
        setting = setting or next((s["setting"] for s in heard.values() if s["setting"]), "")
        waits = [(s["waited"], s["what"]) for s in here.values()] + ([] if elsewhere else [(waited, what)])
        waited, what = max(waits or [(waited, what)])
        stalled = {w.peers[r].rank: f"{w.peers[r].name()} has not reached {what} for {waited:.0f} s "
                                    "(stopped? SIGSTOP, a debugger, swapping)" for r in missing}
        error: KVDistError = RankStalled(f"{'; '.join(stalled.values())}; seen by rank {me} ({setting})",
                                         stalled)
    else:
        calls = {w.peers[r].rank: s["what"] for r, s in heard.items()} | {me: what}
        odd = "; ".join(f"{w.peers[r].name()} waits in {s['what']}" for r, s in sorted(heard.items())
                        if s["what"] != what)
        error = CollectiveMismatch(f"rank {me} waits in {what}, but {odd or 'no rank arrived in time'}: "
                                   "the ranks called different collectives", calls)
    return _end(error, w)


def _all_here(heard: dict[int, dict], what: str, elsewhere: bool) -> bool:
    """Whether every rank, this one and each peer heard, waits in this communicator's
    collective, the one this rank waits in: then one came late, after a deadline."""
    return not elsewhere and all(not s.get("elsewhere") and s["what"] == what for s in heard.values())
