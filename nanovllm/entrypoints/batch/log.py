"""A batch job's files: the input (its stamp, the lines still to do) and the output as a write-ahead log.

The output is append-only JSONL. Lines are written in batches, each written, flushed and
fsynced at once, so a job killed at any moment (SIGKILL included) leaves whole result lines
plus at most one torn last line. Reopening the log reads which input lines have a result (each
result names its input "line" and "custom_id"); once the job has matched them against its input
(`resume`), the torn tail is cut off and the restarted job skips the done lines, ending with
exactly one result per input line. A file that is not a job's results is never cut or appended
to: it is refused (or, asked to, replaced). The input is stamped (lines, size, mtime, SHA-256)
when the job starts and again when it ends, so a file changed under a running job is noticed.
One process writes the log (it holds an exclusive lock on the file, so a second job on the same
output is refused); it knows nothing of what a line means or how it is run.
"""
import fcntl
import hashlib
import json
import os
from time import monotonic
from typing import Callable, Iterator, NamedTuple

# A finished result reaches the disk within this many seconds (one fsync per flush; an fsync
# costs milliseconds, so flushing after every engine step would slow short requests down).
DEFAULT_FLUSH_INTERVAL = 0.5
# ... or sooner, once this many lines wait: bounds what a burst of finished requests holds.
MAX_PENDING_LINES = 4096
READ_CHUNK_BYTES = 1 << 20  # for stamping the input
# Every result line starts so (json.dumps keeps key order and custom_id is the first key): a torn
# last line is one only if it starts with (a part of) it; any other unfinished last line is not ours.
RESULT_PREFIX = b'{"custom_id": '
# Keys every result line has, a success's and an error line's alike.
RESULT_KEYS = ("custom_id", "line", "error")
# How much of a line a refusal quotes.
QUOTE_BYTES = 80


class BatchJobError(RuntimeError):
    """A job that started but cannot end with one result per input line (the input changed,
    results are missing, the engine fails on every request, the output cannot be written). The
    output written so far is kept; the message is one line for the user."""


class InputStamp(NamedTuple):
    """What the input file was when it was read whole: a changed file has another stamp."""
    num_lines: int
    size: int
    mtime_ns: int
    sha256: str


def stamp_input(path: str, visit: Callable[[int, bytes], None] | None = None) -> InputStamp:
    """Read the input once: its stamp; `visit(number, raw)` is called on each line (raw without
    its line ending) when given."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        stat = os.fstat(f.fileno())
        if visit is None:
            count, last = 0, b"\n"
            while chunk := f.read(READ_CHUNK_BYTES):
                digest.update(chunk)
                count += chunk.count(b"\n")
                last = chunk[-1:]
            count += last != b"\n"
        else:
            count = 0
            for count, raw in enumerate(f, start=1):
                digest.update(raw)
                visit(count, raw.rstrip(b"\n").rstrip(b"\r"))
    return InputStamp(count, stat.st_size, stat.st_mtime_ns, digest.hexdigest())


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


def pending_lines(path: str, done: DoneLines) -> Iterator[InputLine]:
    """The input lines without a result yet, in order, read one at a time."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number not in done:
                yield InputLine(number, raw.rstrip(b"\n").rstrip(b"\r"))


class ResultLog:
    """The output file, locked and opened for appending. On opening, its existing results are
    read (`existing`: input line -> custom_id) and checked to be result lines, but nothing is
    changed until `resume` (after the job has matched them against its input) cuts off a torn
    last line; `append` queues a result line, `maybe_flush`/`flush` make the queued lines durable.
    `overwrite` empties an existing file first, whatever it holds."""

    def __init__(self, path: str, flush_interval: float = DEFAULT_FLUSH_INTERVAL, overwrite: bool = False):
        self.path = path
        self.flush_interval = flush_interval
        self.done = DoneLines()
        self.existing: dict[int, str] = {}  # input line -> custom_id of the results in the file when opened
        self.num_existing = 0  # results already in the file when it was opened
        self.torn_bytes = 0  # size of the torn last line that resume() cuts off (0: none)
        self._good_end = 0  # byte offset just past the last whole line
        if os.path.isdir(path):
            raise ValueError(f"output={path!r} is a directory; it must be a file path")
        created = not os.path.exists(path)
        try:
            self._file = open(path, "ab")  # O_APPEND: every write lands at the end, after any repair
        except OSError as exc:
            raise ValueError(f"output={path!r} cannot be opened for writing: {exc.strerror}") from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ValueError(f"output={path!r} is being written by another running job; two jobs on one "
                             "output would interleave their results") from None
        try:
            if overwrite and not created:
                self._file.truncate(0)
            if created or overwrite:  # make the new (or emptied) file durable, its directory entry too
                os.fsync(self._file.fileno())
                _fsync_dir(os.path.dirname(os.path.abspath(path)))
            else:
                self._read_existing()
        except BaseException:
            self._file.close()
            raise
        self._pending: list[bytes] = []
        self._last_flush = monotonic()

    def _refuse(self, number: int, why: str) -> ValueError:
        return ValueError(f"output={self.path!r} exists and is not this job's results (its line {number} {why}); "
                          "pass --overwrite to replace it, or choose another --output")

    def _read_existing(self) -> None:
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):  # an unfinished last line: torn, if it is the start of a result
                    if not (raw.startswith(RESULT_PREFIX) or RESULT_PREFIX.startswith(raw)):
                        raise self._refuse(number, f"is {raw[:QUOTE_BYTES]!r}, with no newline")
                    self.torn_bytes = len(raw)
                    break
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = None
                if not isinstance(obj, dict) or any(key not in obj for key in RESULT_KEYS):
                    raise self._refuse(number, f"is {raw[:QUOTE_BYTES]!r}, not a result line with keys "
                                               f"{list(RESULT_KEYS)}")
                line, custom_id = obj["line"], obj["custom_id"]
                if not isinstance(line, int) or isinstance(line, bool) or line < 1 or not isinstance(custom_id, str):
                    raise self._refuse(number, f"has line={line!r:.40}, custom_id={custom_id!r:.40}; a result "
                                               "names its input line (an integer >= 1) and its custom_id")
                if line in self.existing:
                    raise self._refuse(number, f"is a second result for input line {line}")
                self.existing[line] = custom_id
                self._good_end += len(raw)
        self.num_existing = len(self.existing)

    def resume(self, num_input_lines: int, custom_ids: dict[int, str]) -> None:
        """Take the existing results as done, once they are this input's: each names a line the
        input has, with the custom_id the input gives that line (`custom_ids`, for every line of
        `existing`). Then cut off a torn last line, if any."""
        for line, custom_id in self.existing.items():
            if line > num_input_lines:
                raise self._refuse_input(f"has a result for input line {line} but the input has {num_input_lines} "
                                         "lines")
            if custom_ids.get(line) != custom_id:
                raise self._refuse_input(f"has custom_id {custom_id!r:.80} for input line {line}, where the input "
                                         f"has {custom_ids.get(line)!r:.80}")
        for line in self.existing:
            self.done.add(line)
        self.existing = {}
        if self.torn_bytes:
            self._file.truncate(self._good_end)
            self._file.flush()
            os.fsync(self._file.fileno())

    def _refuse_input(self, why: str) -> ValueError:
        return ValueError(f"output={self.path!r} {why}: it holds the results of another input; pass --overwrite "
                          "to replace it, or choose another --output")

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
            try:
                self._file.write(b"".join(self._pending))
                self._pending.clear()
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:  # a full disk, a lost mount: the results on disk so far stay
                raise BatchJobError(f"cannot write the output {self.path!r}: {exc.strerror}") from None
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
