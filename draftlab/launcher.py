"""`accelerate launch` as launch.sh runs it: the same command, with a failed training process reported in one line.

    python -m draftlab.launcher --config_file ... --num_processes 2 draftlab/train.py recipe=NAME ...

Takes exactly `accelerate launch`'s arguments and runs accelerate's own launch code. Two things differ, both about
failures of the training processes (an error found after they started, such as an empty data file):
- torchrun answers a process that exits with an error by raising ChildFailedError, a traceback and a report box
  printed after the process's own one-line message. Here it becomes one line naming the rank and its exit code,
  and the launcher exits with that rank's code (2 for a mistake the user can fix, as in every draftlab command).
- Every rank that meets the same mistake prints the same `draftlab: error:` line; it is shown once.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

ERROR_PREFIX = b"draftlab: error:"


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's agent logs the same failure (and the SIGTERM it then sends the other ranks) on top of it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    relay = ErrorLineFilter()
    try:
        launch_command(args)
    except ChildFailedError as e:
        relay.close()
        rank, failure = e.get_first_failure()  # the rank that failed first (torchrun then stops the others)
        code = failure.exitcode if failure.exitcode > 0 else 1
        how = f"was stopped by signal {-failure.exitcode}" if failure.exitcode < 0 else f"exited with code {code}"
        print(f"launch.sh: training stopped: rank {rank} {how} (its message is above)", file=sys.stderr)
        return code
    except subprocess.CalledProcessError as e:  # one process: accelerate runs it itself and raises this
        relay.close()
        code = e.returncode if e.returncode > 0 else 1
        print(f"launch.sh: training stopped: the process exited with code {e.returncode} (its message is above)",
              file=sys.stderr)
        return code
    except KeyboardInterrupt:
        relay.close()
        return 130
    relay.close()
    return 0


class ErrorLineFilter:
    """Relays this process's stderr (and so the training processes', which inherit it) unchanged, except that a
    `draftlab: error:` line already shown is dropped. Lines are passed on as they come; only a line that starts
    like an error line is held until its end, so progress bars (carriage returns, no newline) stay live."""

    def __init__(self):
        self.real = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.read = read
        self.seen: set[bytes] = set()
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        pending, at_start = b"", True  # pending: the start of a line that may be an error line
        while chunk := os.read(self.read, 65536):
            data, pending, out = pending + chunk, b"", []
            while data:
                end = min((i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0), default=-1)
                piece = data if end < 0 else data[:end + 1]
                maybe_error = at_start and (piece.startswith(ERROR_PREFIX) or ERROR_PREFIX.startswith(piece))
                if maybe_error and end < 0:  # wait for the rest of the line
                    pending = data
                    break
                data = data[len(piece):]
                at_start = end >= 0
                if maybe_error and piece.startswith(ERROR_PREFIX):
                    if piece in self.seen:
                        continue
                    self.seen.add(piece)
                out.append(piece)
            self._write(b"".join(out))
        self._write(pending)

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.real, data):]

    def close(self) -> None:
        """Restore stderr and let the relay finish what the processes wrote."""
        sys.stderr.flush()
        os.dup2(self.real, 2)  # the pipe's last writer closes: the relay thread reads to the end
        self.thread.join(timeout=5)
        os.close(self.real)


if __name__ == "__main__":
    sys.exit(main())
