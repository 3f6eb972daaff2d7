"""Errors meant for the user, and how a command reports them: one line on stderr, exit code 2.

Every module raises the class of its own layer (a bad config key is a ConfigError, an unreadable checkpoint a
CheckpointError, ...); the message says what is wrong, where, and how to fix it. They live here, below every
other module, so that any module can raise them and the command layer can catch them all without importing
the modules that raise them.
"""
from __future__ import annotations

import argparse
import errno
import shutil
import sys
from pathlib import Path


class ConfigError(ValueError):
    """A configuration problem a user can fix; the message is one line."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and why."""


class DiskFullError(CheckpointError):
    """The disk (or quota) filled up while writing; the message says what was cleaned up and how to continue."""


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and line) and says how to fix it."""


class TargetError(ValueError):
    """The target cannot be found or loaded; the message says what, where, and how to fix it."""


class HubError(Exception):
    """Export or upload failed; the message is one line for the user (never containing the token)."""


class LockError(RuntimeError):
    """Another process holds the lock; the message names it and says what to do."""


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM) turned into an exception by a command that says what it kept: run_guarded
    prints the message as the command's one line and exits with `code` (128 + the signal's number)."""

    def __init__(self, message: str = "", code: int = 130):
        super().__init__(message)
        self.code = code


USER_ERRORS = (ConfigError, CheckpointError, DataError, TargetError, HubError, LockError)


def is_disk_full(e: BaseException) -> bool:
    """An OSError for a full disk or an exhausted quota, or a DiskFullError raised for one."""
    return isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))


# How torch.save and safetensors report a failed write: neither raises an OSError. torch's zip writer raises
# RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 640 vs 598') or '... PytorchStreamWriter
# failed writing file data/0: file write failed' (no errno), safetensors SafetensorError('Error while serializing:
# I/O error: No space left on device (os error 28)').
_WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "I/O error")
_FULL_WORDS = {errno.ENOSPC: ("No space left on device", f"os error {errno.ENOSPC})"),
               errno.EDQUOT: ("Disk quota exceeded", f"os error {errno.EDQUOT})")}
NEARLY_FULL = 64 * 2**20  # free bytes below which a write failure that names no cause is taken for a full disk


def is_write_failure(e: BaseException) -> bool:
    """An OSError, or the error torch.save / safetensors' save_file raise when writing fails (see above)."""
    return isinstance(e, OSError) or (isinstance(e, Exception) and any(w in str(e) for w in _WRITER_FAILURES))


def disk_full_errno(e: BaseException, where: str | Path) -> int | None:
    """ENOSPC or EDQUOT when `e` is a write that failed on a full disk or quota, else None. An OSError carries its
    errno, safetensors names it in its message; torch's writer says nothing of the cause, so there a device of
    `where` with (almost) no space left decides (ask before removing what the failed write left)."""
    if isinstance(e, OSError):
        return e.errno if e.errno in _FULL_WORDS else None
    if not is_write_failure(e):
        return None
    for number, words in _FULL_WORDS.items():
        if any(w in str(e) for w in words):
            return number
    free = free_bytes(where)
    return errno.ENOSPC if free is not None and free < NEARLY_FULL else None


def free_bytes(where: str | Path) -> int | None:
    """Bytes this user may still write on the device of `where` (or of its nearest existing parent)."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def describe_disk_full(e: BaseException) -> str:
    """'no space left on device writing FILE' for messages (a DiskFullError's own message says what it wrote)."""
    if isinstance(e, DiskFullError):
        return str(e)
    reason = "disk quota exceeded" if e.errno == errno.EDQUOT else "no space left on device"
    return reason + (f" writing {e.filename}" if getattr(e, "filename", None) else "")


def run_guarded(fn) -> int:
    """Run fn(); user errors (and a full disk anywhere) become one line on stderr and exit code 2, Ctrl-C exit
    code 130."""
    try:
        fn()
    except USER_ERRORS as e:
        _end_progress_bars()
        print(f"draftlab: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not is_disk_full(e):
            raise
        _end_progress_bars()
        print(f"draftlab: error: {describe_disk_full(e)}: free some space and run the command again", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        _end_progress_bars()  # the line starts on a line of its own, not glued to a progress bar
        print(f"draftlab: {str(e) or 'interrupted'}", file=sys.stderr)
        return getattr(e, "code", 130)
    return 0


def _end_progress_bars() -> None:
    """Close the progress bars an error interrupted, so that its line starts on a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (what, and where to read more), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
