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


# --- the outputs of a command (eval's report and round log, disco's and serve-learn's folders, push's export) ------
# Every command checks each output before any work (`check_output`: not one of its inputs, not another kind of
# thing, writable), holds a lock on it while it runs (`claim_outputs`: a second writer is refused by the first's pid)
# and writes it under a temporary name that is renamed into place when it is complete (`atomic_path`).

def output_lock_path(path: str | Path) -> Path:
    """The lock of an output file or folder: a hidden file beside it (a folder replaced whole keeps its lock)."""
    path = Path(path)
    path = path.resolve() if path.name in ("", ".", "..") else path
    return path.with_name(f".{path.name}.draftlab.lock")


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _inside(inner: Path, outer: Path) -> bool:
    try:
        return inner.resolve().is_relative_to(outer.resolve())
    except OSError:
        return False


def check_output(option: str, path: str | Path, *, folder: bool = False, inputs=(), example: str = "",
                 replaces: bool = False) -> None:
    """ConfigError (one line, nothing written) when `path` cannot be this command's output: it is one of `inputs`
    ((option, path) pairs; for a folder that is replaced whole, `replaces=True`, an input inside it too), it is another
    kind of thing (a folder where a file is written, a file where a folder is), a folder of its path is a file, or it
    cannot be written (tried with a temporary file, removed again). Folders that do not exist yet are fine."""
    import tempfile

    given = Path(path)
    for other, where in inputs:
        if where is None or str(where) == "":
            continue
        where = Path(str(where)).expanduser()
        if _same(given, where):
            raise ConfigError(f"{option} {path} is {other} {where}, an input of this command: writing it would "
                              f"destroy what it reads; choose another {option} (nothing was written)")
        if replaces and where.exists() and _inside(where, given):
            raise ConfigError(f"{option} {path} holds {other} {where}, and this command replaces that folder whole: "
                              f"choose another {option} (nothing was written)")
    if folder:
        if given.exists() and not given.is_dir():
            raise ConfigError(f"{option} {path} is a file, not a folder: give a folder (new or one this command "
                              "wrote), e.g. " + (f"{option} {given.with_suffix('')}_out" if not example else
                                                 f"{option} {example}") + " (nothing was written)")
    elif given.is_dir():
        raise ConfigError(f"{option} {path} is a folder: name the file to write, e.g. {option} {given / example}")
    parent = given if folder else given.parent
    parent = parent.resolve() if parent.name in ("", ".", "..") else parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: {parent} is a file, not a folder: choose another path")
    if given.exists() and not folder and not os.access(given, os.W_OK):
        raise ConfigError(f"{option} {path} exists and cannot be written (permission denied): choose another path")
    probe_dirs = [parent]
    if folder and given.is_dir() and given.resolve() != parent.resolve():
        probe_dirs.append(given)
    if folder and given.parent.exists():  # a folder replaced whole or made: its parent is written too
        probe_dirs.append(given.resolve().parent if given.name in ("", ".", "..") else given.parent)
    for where in dict.fromkeys(probe_dirs):
        try:
            with tempfile.NamedTemporaryFile(dir=where, prefix=".draftlab-write-check-"):
                pass
        except OSError as e:
            raise ConfigError(f"{option} {path}: {where} cannot be written ({e.strerror or type(e).__name__}): "
                              "choose a folder you can write to") from None


class OutputLocks:
    """Locks on a command's outputs, all taken or none (`claim_outputs`); release() drops them."""

    def __init__(self, locks: list[FolderLock]):
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> "OutputLocks":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_outputs(outputs) -> OutputLocks:
    """Lock every (option, path) output of a command (a hidden lock file beside each): LockError naming the holder's
    pid when another process writes one of them; then none is held."""
    held: list[FolderLock] = []
    try:
        for option, path in outputs:
            if path is None:
                continue
            lock = FolderLock(output_lock_path(path), f"{option} {path}",
                              f"wait for that process to finish, or choose another {option}")
            held.append(lock.acquire())
    except BaseException:
        for lock in reversed(held):
            lock.release()
        raise
    return OutputLocks(held)


def temporary_name(path: str | Path) -> Path:
    """Where `path` is written before it is renamed into place: a hidden sibling (a reader never sees half a file)."""
    path = Path(path)
    return path.with_name(f".{path.name}.draftlab-tmp")


class atomic_path:
    """`with atomic_path(path) as tmp:` write tmp; on success it replaces `path` (fsynced), on any failure it is
    removed and `path` is unchanged. A full disk becomes a DiskFullError naming `path` and the space left."""

    def __init__(self, path: str | Path, what: str | None = None):
        self.path = Path(path)
        self.tmp = temporary_name(self.path)
        self.what = what or str(self.path)

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.unlink(missing_ok=True)
        return self.tmp

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            try:
                with open(self.tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(self.tmp, self.path)
                return False
            except BaseException as e:  # noqa: BLE001 (turned into the same cleanup below)
                kind, error = type(e), e
                self.tmp.unlink(missing_ok=True)
                raise self._user_error(e) from None
        self.tmp.unlink(missing_ok=True)
        user = self._user_error(error)
        if user is not error:
            raise user from None
        return False

    def _user_error(self, e: BaseException) -> BaseException:
        from draftlab.errors import DiskFullError, disk_full_errno, free_bytes, human_bytes

        full = disk_full_errno(e, self.path.parent) if isinstance(e, Exception) else None
        if full is None:
            return e
        free = free_bytes(self.path.parent)
        reason = "disk quota exceeded" if full == errno.EDQUOT else "no space left on device"
        room = f" ({human_bytes(free)} free there now)" if free is not None else ""
        return DiskFullError(f"{reason} writing {self.what}{room}: nothing was replaced and no partial file is left; "
                             "free some space and run the command again")


def write_atomic(path: str | Path, data: str | bytes, what: str | None = None) -> None:
    """Write a whole file under a temporary name, then rename it into place (atomic_path)."""
    with atomic_path(path, what) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
