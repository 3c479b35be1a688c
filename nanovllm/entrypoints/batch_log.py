"""A batch job's files: the input lines still to do, and the output as a write-ahead log.

The output is append-only JSONL. Lines are written in batches, each written, flushed and
fsynced at once, so a job killed at any moment (SIGKILL included) leaves whole result lines
plus at most one torn last line. Reopening the log drops that torn tail and learns which input
lines have a result (each result names its input "line"), so the restarted job skips them and
ends with exactly one result per input line. One process writes the log (it holds an exclusive
lock on the file, so a second job on the same output is refused); it knows nothing of what a
line means or how it is run.
"""
import fcntl
import json
import os
from time import monotonic
from typing import Iterator, NamedTuple

# A finished result reaches the disk within this many seconds (one fsync per flush; an fsync
# costs milliseconds, so flushing after every engine step would slow short requests down).
DEFAULT_FLUSH_INTERVAL = 0.5
# ... or sooner, once this many lines wait: bounds what a burst of finished requests holds.
MAX_PENDING_LINES = 4096
READ_CHUNK_BYTES = 1 << 20  # for counting input lines


class InputLine(NamedTuple):
    number: int  # from 1
    raw: bytes  # without its line ending


class DoneLines:
    """Input line numbers that have a result: every line below `watermark`, plus a set above it.

    A job takes input lines in order and keeps a bounded number in flight, so the lines done
    above the watermark are never more than that bound: the set stays small however long the
    input is, both while a job runs and when a restart reads the log.
    """

    def __init__(self):
        self.watermark = 1
        self._above: set[int] = set()
        self.max_line = 0

    def __contains__(self, line: int) -> bool:
        return line < self.watermark or line in self._above

    def __len__(self) -> int:
        return self.watermark - 1 + len(self._above)

    def add(self, line: int) -> bool:
        """Record a done line; False if it was already recorded."""
        if line in self:
            return False
        self._above.add(line)
        self.max_line = max(self.max_line, line)
        while self.watermark in self._above:
            self._above.remove(self.watermark)
            self.watermark += 1
        return True


def count_lines(path: str) -> int:
    """Lines in a file, counted as iterating it does: a last line without a newline counts."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def pending_lines(path: str, done: DoneLines) -> Iterator[InputLine]:
    """The input lines without a result yet, in order, read one at a time."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number not in done:
                yield InputLine(number, raw.rstrip(b"\n").rstrip(b"\r"))


class ResultLog:
    """The output file: opened for appending after its existing results are read (and a torn
    last line, if any, cut off); `append` queues a result line, `maybe_flush`/`flush` make the
    queued lines durable."""

    def __init__(self, path: str, flush_interval: float = DEFAULT_FLUSH_INTERVAL):
        self.path = path
        self.flush_interval = flush_interval
        self.done = DoneLines()
        self.num_existing = 0  # results already in the file when it was opened
        self.torn_bytes = 0  # size of the torn last line cut off on opening (0: none)
        created = not os.path.exists(path)
        self._file = open(path, "ab")  # O_APPEND: every write lands at the end, after any repair
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ValueError(f"output={path!r} is being written by another running job; two jobs on one "
                             "output would interleave their results") from None
        try:
            if created:  # make the new file's directory entry durable too
                _fsync_dir(os.path.dirname(os.path.abspath(path)))
            else:
                self._read_existing()
        except BaseException:
            self._file.close()
            raise
        self._pending: list[bytes] = []
        self._last_flush = monotonic()

    def _read_existing(self) -> None:
        good_end = 0  # byte offset just past the last whole line
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):  # a torn last line: written in part when the job died
                    self.torn_bytes = len(raw)
                    break
                try:
                    line = json.loads(raw)["line"]
                except (ValueError, KeyError, TypeError):
                    line = None
                if not isinstance(line, int) or isinstance(line, bool) or line < 1:
                    raise ValueError(f"output file {self.path!r} line {number} is not a result line of a batch "
                                     f"job ({raw[:80]!r}); pass another --output or move that file away")
                if not self.done.add(line):
                    raise ValueError(f"output file {self.path!r} has two results for input line {line} (the "
                                     f"second at line {number}); it was not written by one batch job")
                good_end += len(raw)
        if self.torn_bytes:
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
        self.num_existing = len(self.done)

    def check_input(self, num_input_lines: int) -> None:
        """Refuse a log holding results for lines the input does not have (another job's output)."""
        if self.done.max_line > num_input_lines:
            raise ValueError(f"output file {self.path!r} has a result for input line {self.done.max_line} but the "
                             f"input has {num_input_lines} lines; is it the output of another input?")

    def append(self, line: int, text: str) -> None:
        """Queue one result line (JSON text without its newline) for input line `line`."""
        if not self.done.add(line):
            raise RuntimeError(f"internal error: a second result for input line {line}; please report it")
        self._pending.append(text.encode("utf-8") + b"\n")

    def maybe_flush(self) -> None:
        if self._pending and (len(self._pending) >= MAX_PENDING_LINES
                              or monotonic() - self._last_flush >= self.flush_interval):
            self.flush()

    def flush(self) -> None:
        """Write every queued line in one write, then flush and fsync."""
        if self._pending:
            self._file.write(b"".join(self._pending))
            self._pending.clear()
            self._file.flush()
            os.fsync(self._file.fileno())
        self._last_flush = monotonic()

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.flush()
            finally:
                self._file.close()  # also releases the lock

    def __enter__(self) -> "ResultLog":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
