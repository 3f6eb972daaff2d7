"""One writer per folder: an exclusive lock held for as long as a run (or an answers cache, or a feature store
being built, or a GGUF conversion) writes there, so a second start is refused, or waits its turn (`acquire(wait=)`,
as a second conversion of one GGUF does), instead of interleaving with the first.

The lock is an `flock` on a lock file that records who holds it (pid, host, start time, command line). The
kernel drops an flock when its process dies, however it dies (kill -9 included), so a lock file left by a
killed process is never in the way: the next start takes it over and says whose it was. Where flock is not
available (no `fcntl`, or a file system without it), the recorded pid is checked for liveness instead; a holder
on another host cannot be checked, so it is trusted, and the message says which file to delete if it is gone.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

from draftlab.errors import ConfigError, LockError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = "draftlab.lock"  # inside a locked folder (run folder, feature store)


def holder_text(info: dict | None) -> str:
    """'pid 123 on host h since 2025-01-01T10:00:00 (python -m draftlab.cli train ...)', or why it is unknown."""
    if not info:
        return "a process that has not written its name yet"
    command = " ".join(str(a) for a in info.get("argv") or [])
    command = f" ({command[:120]}{'...' if len(command) > 120 else ''})" if command else ""
    return f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')}{command}"


def _read(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 65536, 0)
        info = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _alive(info: dict | None) -> bool:
    """Whether the recorded holder may still run (fallback without flock): only a same-host pid can be checked."""
    if not info or info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OSError):
        return True
    return True


class FolderLock:
    """An exclusive lock on `path` (a lock file). `what` names the locked thing in messages, `hint` says what a
    refused user can do. acquire() raises LockError when another process holds it; release() drops it and
    removes the lock file (and the folder holding it when acquire() created that folder and it is empty)."""

    def __init__(self, path: str | Path, what: str, hint: str):
        self.path, self.what, self.hint = Path(path), what, hint
        self.fd: int | None = None
        self.took_over: dict | None = None   # the recorded holder of a stale lock this one replaced
        self._made_dir = False

    def refusal(self, info: dict | None, flock: bool = True) -> str:
        stale = "" if flock else f" (if that process is gone, delete {self.path})"
        return f"{self.what} is in use by {holder_text(info)}{stale}: {self.hint}"

    def acquire(self, wait: float | None = 0.0, poll: float = 0.2) -> "FolderLock":
        """Take the lock; while another live process holds it, wait up to `wait` seconds (None: until it is
        released) before raising LockError."""
        deadline = None if wait is None else time.monotonic() + wait
        self._check_folder()
        self._made_dir = not self.path.parent.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # e.g. a read-only file system, or no permission to create it
            raise ConfigError(f"{self.what}: cannot create {self.path.parent} ({e.strerror or type(e).__name__}): "
                              "choose a place you can write to") from None
        while self.fd is None:
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, os.O_RDWR), False
                except FileNotFoundError:  # released in between: start over
                    continue
            except OSError as e:  # e.g. a folder this user cannot write to
                self._cleanup_dir()
                raise ConfigError(f"{self.what}: cannot write {self.path} ({e.strerror or type(e).__name__}): "
                                  "choose a place you can write to") from None
            try:
                if fcntl is None:
                    raise OSError(errno.ENOSYS, "no fcntl")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self._waited(fd, deadline, poll):
                    continue
                self._refuse(fd, flock=True)
            except OSError:  # no flock here: a file we created is ours, an existing one its recorded holder's
                if not created:
                    info = _read(fd)
                    if _alive(info):
                        if self._waited(fd, deadline, poll):
                            continue
                        self._refuse(fd, flock=False)
                    os.close(fd)
                    self.took_over = info
                    os.unlink(self.path)  # a dead holder's file: remove it, then create ours
                    continue
            else:
                try:  # its last holder may have removed the file between our open and our flock: lock the new one
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                if not created:  # a released lock file is removed, so an existing one is a killed holder's
                    self.took_over = _read(fd)
            self.fd = fd
        self._write()
        return self

    @staticmethod
    def _waited(fd: int, deadline: float | None, poll: float) -> bool:
        """Whether there is time left to try again (then `fd` is closed after a pause of `poll` seconds)."""
        if deadline is not None and time.monotonic() + poll > deadline:
            return False
        os.close(fd)
        time.sleep(poll)
        return True

    def _refuse(self, fd: int, flock: bool):
        info = _read(fd)
        os.close(fd)
        self._cleanup_dir()
        raise LockError(self.refusal(info, flock))

    def _check_folder(self) -> None:
        """ConfigError when the folder that holds the lock file, or a folder above it, is a file."""
        folder = self.path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise ConfigError(f"{self.what}: {folder} is a file, not a folder: choose another path (nothing was "
                              "written)")

    def probe(self) -> None:
        """Raise LockError when another process holds this lock; creates and changes nothing (a check before a
        launch: the run itself takes the lock)."""
        self._check_folder()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            if fcntl is None:
                raise OSError(errno.ENOSYS, "no fcntl")
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: two probes never exclude each other
        except BlockingIOError:
            raise LockError(self.refusal(_read(fd))) from None
        except OSError:
            if _alive(_read(fd)):
                raise LockError(self.refusal(_read(fd), flock=False)) from None
        finally:
            os.close(fd)

    def _write(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "argv": sys.argv}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(info).encode(), 0)

    def release(self) -> None:
        if self.fd is None:
            return
        try:  # removed while still held, so nobody can lock a file that is about to disappear
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
        self._cleanup_dir()

    def _cleanup_dir(self) -> None:
        if self._made_dir:
            try:
                self.path.parent.rmdir()  # only when empty: a start refused before writing leaves nothing behind
            except OSError:
                pass

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def stale_note(lock: FolderLock) -> str | None:
    """One line when acquire() took over the lock of a process that died without releasing it."""
    if lock.took_over is None:
        return None
    return f"{lock.what}: took over the lock of {holder_text(lock.took_over)}, which is no longer running"
