"""The directories kvdist writes into: the private default directory of the disk tier,
checks that a directory can take files (without creating anything), and files that
have no name, so that no crash can leave one behind.

``cache.disk.path: auto`` is ``$TMPDIR/kvdist-<uid>`` when ``TMPDIR`` is set, else
``/var/tmp/kvdist-<uid>`` (``/var/tmp`` is disk-backed where ``/tmp`` is often RAM).
It is created mode 0700 and used only if it is a real directory (not a symlink) owned
by this user: another user cannot plant it, link it elsewhere, or read it."""

from __future__ import annotations

import errno
import os
import stat
import tempfile

AUTO = "auto"


def default_disk_dir() -> str:
    """Where ``cache.disk.path: auto`` puts the disk tier's files."""
    base = os.environ.get("TMPDIR") or ("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
    return os.path.join(os.path.abspath(base), f"kvdist-{os.getuid()}")


def resolve_disk_dir(path: str) -> str:
    """The directory a configured ``cache.disk.path`` means."""
    return default_disk_dir() if path == AUTO else os.path.abspath(path)


def nearest_existing(path: str) -> str:
    """``path`` itself if it exists, else its closest existing ancestor."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer can still allocate under ``directory`` (or, if it
    does not exist yet, under the ancestor it would be created in)."""
    st = os.statvfs(nearest_existing(directory))
    return st.f_bavail * st.f_frsize


# Space this process's disk tiers hold, by filesystem (st_dev) and file descriptor: a
# config re-checked while its own tier is open (a copy with other keys changed) counts
# the tier's file as free, or a disk that exactly fits would refuse its own job.
_reserved: dict[int, tuple[int, int]] = {}  # fd -> (st_dev, bytes)


def reserve(fd: int, nbytes: int) -> None:
    """Note that the open file ``fd`` holds ``nbytes`` of its filesystem for this job."""
    _reserved[fd] = (os.fstat(fd).st_dev, nbytes)


def release(fd: int) -> None:
    """``fd`` is about to close: its space is no longer this job's (idempotent)."""
    _reserved.pop(fd, None)


def reserved_bytes(directory: str) -> int:
    """Bytes this process's open disk tiers hold on the filesystem of ``directory``."""
    dev = os.stat(nearest_existing(directory)).st_dev
    return sum(n for d, n in _reserved.values() if d == dev)


def files_problem(directory: str) -> str | None:
    """Why ``directory`` (created if missing) could not hold kvdist's files, or None.
    Creates nothing: an existing directory is probed with a file that has no name."""
    where = nearest_existing(directory)
    if not os.path.isdir(where):
        return f"{where} is not a directory"
    if os.statvfs(where).f_blocks == 0:  # proc, sysfs and the like: no storage behind it
        return f"{where} is not writable (a pseudo filesystem without storage)"
    try:
        fd = open_unnamed(where, probe=True)
    except OSError as e:
        return f"{where} is not writable: {e.strerror}"
    os.close(fd)
    return None


def open_unnamed(directory: str, *, probe: bool = False) -> int:
    """A new read-write file in ``directory`` that has no name (``O_TMPFILE``): it
    vanishes when its last descriptor closes, however the process ends. Where the
    filesystem cannot do that, a named file is made and unlinked at once."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, flags | os.O_TMPFILE, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, name = tempfile.mkstemp(prefix=".kvdist-probe-" if probe else "kvdist-", dir=directory)
    os.unlink(name)
    return fd


def make_private_dir(directory: str) -> None:
    """Create ``directory`` mode 0700 if needed; refuse it unless it is a real
    directory (not a symlink) owned by this user, and take group/other access away."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"{directory} is a symlink; kvdist's private directory must not be one "
                              "(remove it)")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{directory} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.getuid()}); remove it or set cache.disk.path")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)


def prepare_disk_dir(directory: str) -> None:
    """Create the disk tier's directory: the per-user default privately (see
    :func:`make_private_dir`), a configured one with its parents, as usual."""
    if directory == default_disk_dir():
        make_private_dir(directory)
    else:
        os.makedirs(directory, exist_ok=True)
