"""One job per checkpoint directory: a lock file that works on shared file systems.

``DIR/hpcckpt.lock`` holds its owner as JSON (host, pid, Slurm job id, since when,
the host's boot id and the process start time). It is taken atomically with
``link()`` of a fully written private file onto the lock name (atomic on NFS, Lustre
and GPFS, unlike ``flock``), or ``O_CREAT | O_EXCL`` where hard links are not
supported; a background thread refreshes its mtime every ``refresh`` seconds.

A lock is *stale*, and taken over with a warning, when its owner is certainly gone:

- same host: the pid is not alive, or it is another process now (other start
  time), or the host rebooted since (other boot id);
- the same Slurm job id as ours: an earlier run of this very job (Slurm requeued
  it; it never runs two instances of one job);
- another host: the lock was not refreshed for ``stale_after`` seconds.

Otherwise, after waiting up to ``wait`` seconds (10) for the owner to let go,
:class:`DirectoryLocked` says who holds it. The same process may lock a
directory again (a second Checkpointer on it): the lock is shared and counted.
Taking over a stale lock renames it aside first, so of two processes that find it
stale at once only one wins.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hpcckpt import procfs
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.io.durability import rename
from hpcckpt.store.io.safety import FILE_MODE, write_private

log = logging.getLogger("hpcckpt.store")

LOCK_NAME = "hpcckpt.lock"
REFRESH = 30.0
STALE_AFTER = 300.0
#: Seconds to wait for a live owner to let go before refusing (a crashed job's ranks may
#: outlive their launcher briefly).
WAIT = 10.0

_held: dict[str, tuple[DirectoryLock, int]] = {}  # lock path -> (lock, users) in this process
_held_mutex = threading.Lock()


class DirectoryLocked(CheckpointError):
    """Another live job holds the checkpoint directory."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None."""
    return procfs.start_ticks(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_owner(path: Path) -> dict[str, Any] | None:
    """The owner recorded in a lock file, or None if missing or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        data = json.loads(os.read(fd, 8192))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else None


def describe(owner: dict[str, Any] | None, path: Path) -> str:
    if owner is None:
        return f"an unreadable lock file {path}"
    since = owner.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    job = owner.get("job_id") or "none"
    return (
        f"host {owner.get('host')}, pid {owner.get('pid')}, Slurm job {job}, "
        f"user {owner.get('user')}, since {when}"
    )


class DirectoryLock:
    """The lock of one checkpoint directory; :meth:`acquire`, then :meth:`release`."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        refresh: float = REFRESH,
        stale_after: float = STALE_AFTER,
        mode: int = FILE_MODE,
        wait: float | None = None,
        job_id: str | None = None,
    ) -> None:
        self.directory = Path(directory).absolute()
        self.path = self.directory / LOCK_NAME
        self.refresh = refresh
        self.stale_after = stale_after
        self.wait = WAIT if wait is None else wait
        self.mode = mode
        self.token = secrets.token_hex(8)
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job_id": job_id,
            "user": os.environ.get("USER") or str(os.getuid()),
            "since": time.time(),
            "boot_id": _boot_id(),
            "start": _start_ticks(os.getpid()),
            "token": self.token,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    # -- acquire ---------------------------------------------------------------------------
    def _try_create(self) -> bool:
        """Create the lock atomically with our owner record; False if it exists."""
        text = json.dumps(self.owner) + "\n"
        tmp = self.directory / f".{LOCK_NAME}.{self.token}"
        write_private(tmp, text, self.mode)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE/object stores): exclusive create
            try:
                write_private(self.path, text, self.mode, replace=False)
                return True
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)

    def stale_reason(self, owner: dict[str, Any] | None, mtime: float) -> str | None:
        """Why the lock of ``owner`` (last refreshed at ``mtime``) is stale, or None if live."""
        age = time.time() - mtime
        if owner is None:
            return f"unreadable and not refreshed for {age:.0f} s" if age > 60 else None
        me = self.owner
        if owner.get("host") == me["host"]:
            pid = owner.get("pid")
            if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
                return "its host rebooted since"
            if not isinstance(pid, int) or not _alive(pid):
                return f"process {pid} is not running"
            start = _start_ticks(pid)
            if owner.get("start") is not None and start is not None and start != owner["start"]:
                return f"process {pid} is another process now"
            return None
        if me["job_id"] and owner.get("job_id") == me["job_id"]:
            return f"it is an earlier run of this Slurm job {me['job_id']} (requeued)"
        if age > self.stale_after:
            return f"not refreshed for {age:.0f} s (more than {self.stale_after:.0f} s)"
        return None

    def acquire(self) -> DirectoryLock:
        """Take the lock or raise DirectoryLocked naming the owner; returns the lock held."""
        key = str(self.path)
        with _held_mutex:
            if key in _held:  # this process holds it already: share
                lock, users = _held[key]
                _held[key] = (lock, users + 1)
                return lock
            deadline = time.monotonic() + self.wait
            waited = False
            for _ in range(100_000):
                if self._try_create():
                    self._start()
                    _held[key] = (self, 1)
                    return self
                try:
                    mtime = os.lstat(self.path).st_mtime
                except FileNotFoundError:
                    continue  # released meanwhile
                owner = read_owner(self.path)
                if (
                    owner is not None
                    and owner.get("pid") == os.getpid()
                    and (owner.get("host") == self.owner["host"])
                ):
                    reason = "it was left by this very process"
                else:
                    reason = self.stale_reason(owner, mtime)
                if reason is None:
                    if owner is None or time.monotonic() < deadline:
                        # being written right now, or a job that is ending (a crashed job's
                        # last ranks can outlive mpirun by a second or two): wait a little
                        if owner is not None and not waited:
                            waited = True
                            log.warning(
                                "checkpoint directory %s is locked by %s: waiting up to %.0f s",
                                self.directory,
                                describe(owner, self.path),
                                self.wait,
                            )
                        time.sleep(0.1)
                        continue
                    raise DirectoryLocked(
                        f"checkpoint directory {self.directory} is in use by another job: "
                        f"{describe(owner, self.path)} (lock file {self.path}, refreshed "
                        f"{time.time() - mtime:.0f} s ago). Two jobs saving into one directory "
                        "would overwrite each other's checkpoints: use another directory, or "
                        "wait for that job to end. If it is dead, its lock goes stale "
                        f"{self.stale_after:.0f} s after its last refresh; or delete {self.path}"
                    )
                self._break(owner, reason)
        raise DirectoryLocked(f"could not take the lock {self.path}: it keeps changing hands")

    def _break(self, owner: dict[str, Any] | None, reason: str) -> None:
        """Move a stale lock aside (one winner among racers) and delete it."""
        aside = self.directory / f".{LOCK_NAME}.stale.{self.token}"
        try:
            rename(self.path, aside, durable=False)
        except FileNotFoundError:
            return  # someone else broke it first
        moved = read_owner(aside)
        if owner is not None and (moved or {}).get("token") != owner.get("token"):
            # A fresh lock replaced the stale one between our look and the rename: put it back.
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            return
        log.warning(
            "taking over the stale lock of %s (%s): %s",
            self.directory,
            describe(owner, self.path),
            reason,
        )
        aside.unlink(missing_ok=True)

    # -- hold --------------------------------------------------------------------------------
    def _start(self) -> None:
        self.held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._refresh_loop, name="hpcckpt-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh):
            try:
                if (read_owner(self.path) or {}).get("token") != self.token:
                    log.error("the lock %s is no longer ours: another job took it", self.path)
                    return
                os.utime(self.path, follow_symlinks=False)
            except OSError as exc:  # a heartbeat must never stop the computation
                log.warning("cannot refresh the lock %s: %s", self.path, exc)

    def join(self, timeout: float) -> None:
        """Once given back, wait up to ``timeout`` seconds for its refresh thread to end."""
        thread = self._thread
        if not self.held and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def release(self) -> None:
        """Give the lock back (when the last user of this process releases it)."""
        key = str(self.path)
        with _held_mutex:
            lock, users = _held.get(key, (None, 0))
            if lock is None:
                return
            if users > 1:
                _held[key] = (lock, users - 1)
                return
            del _held[key]
            lock._stop.set()
            lock.held = False
            atexit.unregister(lock.release)
            if (read_owner(lock.path) or {}).get("token") == lock.token:
                try:
                    lock.path.unlink(missing_ok=True)
                except OSError as exc:  # the directory became unwritable: the error that
                    # made it so was said already; a lock left behind goes stale (its
                    # process ends), and the next run takes it over
                    log.debug("cannot remove the lock %s: %s", lock.path, exc)
