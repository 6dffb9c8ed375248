"""Running one job: mpiexec started in a session of its own that dies with the
launcher, its output passed through, a stop signal forwarded, and the one line that
names the rank that died first.

- SIGINT, SIGTERM, SIGHUP to the launcher go to mpiexec (a terminal's Ctrl-C reaches
  only the launcher: mpiexec has its own session, so it gets one SIGINT, not two); the
  ranks stop at their next step and close their caches. A second signal, or
  ``STOP_GRACE_S`` without an end, releases the watchers, which stop their ranks
  (SIGTERM, SIGKILL 2.5 s later), so mpiexec ends by itself and cleans up after itself
  (Hydra leaves its /tmp/hydra_hwloc_xmlfile_* when killed); ``KILL_AFTER_S`` later it
  is killed all the same.
- A launcher killed outright (SIGKILL, a crash): mpiexec gets SIGTERM from the kernel
  (``PR_SET_PDEATHSIG``) and forwards it to the ranks; each rank's watcher sees its
  connection close and stops its rank (SIGTERM, then SIGKILL) and removes what the
  ranks leave in /dev/shm."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import resource
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..process import printable_anywhere
from . import args as launch_args
from .leftovers import remove_leftovers, shm_segments
from .mpiexec import REPO, build_command, find_mpiexec, find_python, flavor, libmpi_of
from .server import RankWatch

__all__ = ["KILL_AFTER_S", "STOP_GRACE_S", "STOP_SIGNALS", "Job", "main"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 1.5
KILL_AFTER_S = 5.0
PIPE_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1
_F_SETPIPE_SZ = 1031


def _dies_with(parent: int):
    """A preexec_fn: the child gets SIGTERM when ``parent`` (this launcher) dies."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl: as if just after
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class Job:
    """mpiexec running under this launcher (``with Job(...) as job: job.wait()``): the
    signal handlers are the launcher's while it runs and restored after."""

    def __init__(self, cmd: list[str], env: dict[str, str], watch: RankWatch):
        self.cmd, self.env, self.watch = cmd, env, watch
        self.signals: list[int] = []  # stop signals received, in order
        self.killed = False  # whether the launcher killed mpiexec
        self.mid_line = False  # whether mpiexec's stderr left a line unfinished
        self._grace_end: float | None = None  # when to release the watchers
        self._kill_at: float | None = None  # when to kill mpiexec
        self._saved: dict[int, object] = {}

    def __enter__(self) -> Job:
        # mpiexec holds the read ends of its own output pipes too: when the launcher is
        # killed, what the stopping ranks still print stays in the pipes (1 MiB each)
        # instead of failing mpiexec's writes (EPIPE), which made Hydra leave without its
        # clean-up (a /tmp/hydra_hwloc_xmlfile_* stayed).
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd in (out_r, err_r):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        try:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=os.getcwd(), stdout=out_w, stderr=err_w,
                                         start_new_session=True, pass_fds=(out_r, err_r),
                                         preexec_fn=_dies_with(os.getpid()))
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout, self.stderr = out_r, err_r
        for sig in STOP_SIGNALS:
            self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        if self.proc.poll() is None:  # the launcher itself failed: the job goes with it
            self.proc.kill()
            self.proc.wait()
        self.watch.close()
        for fd in (self.stdout, self.stderr):
            os.close(fd)

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        if self.proc.poll() is not None:
            return
        if len(self.signals) == 1:
            self._grace_end = time.monotonic() + STOP_GRACE_S
            self.proc.send_signal(signum)
        elif self._grace_end is not None:  # acted on by the wait loop, not here: the handler
            self._grace_end = 0.0  # may interrupt it anywhere

    def _release(self) -> None:
        """Let every watcher stop its rank now; mpiexec ends with them (else is killed)."""
        self.watch.release()
        self._kill_at = time.monotonic() + KILL_AFTER_S

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.killed = True
            self.proc.kill()

    def wait(self) -> int:
        """Pass mpiexec's output through until it ended (and its pipes closed), with the
        watchers' reports; returns mpiexec's exit status (128+N for a signal)."""
        outs = {self.stdout: 1, self.stderr: 2}  # our fd for each
        for fd in outs:
            self.watch.sel.register(fd, 1, "out")

        def on_output(key) -> None:
            if not self._pass(key.fd, outs[key.fd]):
                self.watch.sel.unregister(key.fd)
                del outs[key.fd]

        deadline = None
        while True:
            if self._grace_end is not None and time.monotonic() > self._grace_end:
                self._grace_end = None
                self._release()
            if self._kill_at is not None and time.monotonic() > self._kill_at:
                self._kill_at = None
                self._kill()
            if deadline is None and self.proc.poll() is not None:
                deadline = time.monotonic() + 2.0  # for orphans holding the pipes, and late reports
            if deadline is not None and (time.monotonic() > deadline or
                                         (not outs and (self.proc.returncode == 0 or self.watch.settled()))):
                break
            self.watch.poll(0.05, on_output)
        for fd in outs:
            self.watch.sel.unregister(fd)
        code = self.proc.returncode
        if code and self.signals:  # a stopped job ends as the signal says (Open MPI's mpirun: 1)
            return 128 + self.signals[0]
        return 128 - code if code < 0 else code

    def _pass(self, fd: int, out: int) -> bool:
        """mpiexec's output from ``fd`` to our ``out`` as it comes; False once it ended
        or ``out`` no longer takes it (mpiexec then learns it as before)."""
        try:
            data = os.read(fd, 65536)
        except OSError:
            return False
        if not data:
            return False
        self.watch.banner.feed(out, data)
        if out == 2 and data.strip(b"\0"):
            self.mid_line = not data.rstrip(b"\0").endswith(b"\n")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(out, view):]
        except OSError:
            return False
        return True


def _environment(a: launch_args.LaunchArgs, mpiexec: str, kind: str) -> dict[str, str]:
    env = dict(os.environ)
    if a.timeout is not None:
        env["MPIEXEC_TIMEOUT"] = str(a.timeout)
    else:
        env.setdefault("MPIEXEC_TIMEOUT", str(launch_args.DEFAULT_TIMEOUT_S))
    if env["MPIEXEC_TIMEOUT"] == "0":
        del env["MPIEXEC_TIMEOUT"]
    env.setdefault("PYTHONUNBUFFERED", "1")
    if kind == "openmpi" and os.geteuid() == 0:  # Open MPI 5 reads these instead of the flag
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    libmpi = libmpi_of(mpiexec, kind)
    if libmpi is not None:
        env.setdefault("MPI4PY_LIBMPI", libmpi)
    return env


def _more_descriptors() -> None:
    """The soft limit of open files raised to the hard one: a connection per rank."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None, checkout: Path | None = None) -> int:
    """kvdist-launch (see args.HELP); returns its exit status."""
    repo = checkout or REPO
    printable_anywhere()
    try:
        a = launch_args.parse(sys.argv[1:] if argv is None else argv)
        python = find_python(a.python, repo)
        if python is None:
            raise launch_args.fail(f"--python {a.python!r}: not an executable")
    except SystemExit as e:
        return int(e.code or 0)
    mpiexec = find_mpiexec(a.mpiexec, python, repo)
    if mpiexec is None:
        given = a.mpiexec or os.environ.get("MPIEXEC")
        why = (f"{given!r} is not an executable" if given else
               "none found: `make venv` installs MPICH into .venv, or set MPIEXEC=/path/to/mpiexec")
        print(f"kvdist-launch: mpiexec: {why}", file=sys.stderr)
        return 127
    kind = flavor(mpiexec)
    env = _environment(a, mpiexec, kind)
    watch = None
    if not a.dry_run:  # where the ranks' watchers report (Open MPI forwards it with -x)
        _more_descriptors()
        watch = RankWatch(a.np, local=a.hostfile is None, token=secrets.token_hex(16))
        env.update(watch.env())
    cmd = build_command(a.np, a.hostfile, a.ppn, a.module, a.command, mpiexec, kind, python, env)
    shown = [f"{k}={shlex.quote(env[k])}" for k in ("MPIEXEC_TIMEOUT", "MPI4PY_LIBMPI") if k in env]
    line = " ".join([*shown, shlex.join(cmd)])
    if watch is None:
        print(line)
        return 0
    print(f"kvdist-launch: {line}", file=sys.stderr, flush=True)
    segments = shm_segments()
    with Job(cmd, env, watch) as job:
        code = job.wait()
    first = watch.verdict()
    if code and first:
        start = "\n" if job.mid_line else ""  # Open MPI's banner ends in a NUL, no newline
        print(f"{start}kvdist: {first}; the job ends", file=sys.stderr, flush=True)
    if watch.bad_lines:
        print(f"kvdist-launch: ignored {watch.bad_lines} bad line(s) on the watchers' port", file=sys.stderr)
    gone = remove_leftovers(segments)
    if gone:
        print(f"kvdist-launch: removed {gone} shared-memory file(s) the job left in /dev/shm",
              file=sys.stderr)
    return code
