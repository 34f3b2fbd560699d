"""Per-role, per-rank logging: human lines in ``logs/<role>/<rank>.log``, machine lines in
``logs/<role>/metrics.jsonl``.

Every human line carries time, job id, role, rank and (when set) step and weight version,
so ``grep`` over a 1,000-GPU job's logs finds one rank's story.  Files are line-buffered:
``neon-hpc tail -f`` sees a line as soon as it is written.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from neon_hpc.util.bounded import LOG_LINE_CAP, clip_text


def last_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a (log) file, reading only its end."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        block = min(size, max(4096, n * 400))
        f.seek(size - block)
        data = f.read().decode(errors="replace")
    lines = data.splitlines()
    if block < size:
        lines = lines[1:]  # first line is probably cut
    return lines[-n:] if n > 0 else []


def job_id() -> str:
    """The Slurm job id (het jobs: the leader's), or ``local`` outside Slurm."""
    return os.environ.get("SLURM_HETJOB_ID") or os.environ.get("SLURM_JOB_ID") or "local"


class _Context(logging.Filter):
    def __init__(self, role: str, rank: int | str):
        super().__init__()
        self.role, self.rank = role, rank
        self.step: int | None = None
        self.version: int | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if len(msg) > LOG_LINE_CAP:   # a message quoting outside input (a response, a tool call)
            record.msg, record.args = clip_text(msg, LOG_LINE_CAP), ()
        record.job = job_id()
        record.role, record.rank = self.role, self.rank
        extra = []
        if self.step is not None:
            extra.append(f"step={self.step}")
        if self.version is not None:
            extra.append(f"v={self.version}")
        record.ctx = (" " + " ".join(extra)) if extra else ""
        return True


FORMAT = "%(asctime)s job=%(job)s %(role)s[%(rank)s]%(ctx)s %(levelname)s %(message)s"


class RoleLogger:
    """A logger bound to one role and rank, plus a metrics.jsonl writer.

    >>> log = RoleLogger.open(run_dir, "trainer", 0)
    >>> log.info("claimed %d shards", 3)
    >>> log.metrics(step=4, loss=0.1)
    """

    def __init__(self, logger: logging.Logger, ctx: _Context, metrics_path: Path | None, sinks=None):
        self.logger, self._ctx = logger, ctx
        self._metrics_path = metrics_path
        self._metrics_f = open(metrics_path, "a", buffering=1) if metrics_path else None
        self._sinks = sinks   # TensorBoard / W&B (neon_hpc.util.logsinks), when the logging section enables them

    @classmethod
    def open(cls, run_root: str | os.PathLike | None, role: str, rank: int | str,
             echo: bool = True, level: int = logging.INFO) -> "RoleLogger":
        name = f"neon_hpc.{role}.{rank}"
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = False
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()
        ctx = _Context(role, rank)
        fmt = logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
        metrics_path = None
        if run_root is not None:
            d = Path(run_root) / "logs" / role
            d.mkdir(parents=True, exist_ok=True)
            fh = logging.StreamHandler(open(d / f"{rank}.log", "a", buffering=1))
            fh.setFormatter(fmt)
            fh.addFilter(ctx)
            logger.addHandler(fh)
            metrics_path = d / "metrics.jsonl"
        sinks = None
        if run_root is not None:
            from neon_hpc.util.logsinks import open_sinks  # deferred: heavy (neon_hpc.util.logsinks: pydantic)
            sinks = open_sinks(Path(run_root), role, rank)
        if echo:
            sh = logging.StreamHandler(sys.stderr)
            sh.setFormatter(fmt)
            sh.addFilter(ctx)
            logger.addHandler(sh)
        return cls(logger, ctx, metrics_path, sinks)

    def set(self, step: int | None = None, version: int | None = None) -> None:
        if step is not None:
            self._ctx.step = step
        if version is not None:
            self._ctx.version = version

    def debug(self, msg: str, *a: Any) -> None: self.logger.debug(msg, *a)
    def info(self, msg: str, *a: Any) -> None: self.logger.info(msg, *a)
    def warning(self, msg: str, *a: Any) -> None: self.logger.warning(msg, *a)
    def error(self, msg: str, *a: Any) -> None: self.logger.error(msg, *a)

    def metrics(self, **fields: Any) -> None:
        """Append one JSON line (with time, job, role, rank) to ``metrics.jsonl``."""
        if self._metrics_f is None:
            return
        rec = {"time": time.time(), "job": job_id(), "role": self._ctx.role, "rank": self._ctx.rank}
        if self._ctx.step is not None:
            rec["step"] = self._ctx.step
        rec.update(fields)
        self._metrics_f.write(json.dumps(rec, default=float) + "\n")
        if self._sinks is not None:
            self._sinks.write(rec)

    def close(self) -> None:
        for h in list(self.logger.handlers):
            self.logger.removeHandler(h)
            h.close()
        if self._metrics_f:
            self._metrics_f.close()
        if self._sinks is not None:
            self._sinks.close()
            self._sinks = None


def _records(lines) -> list[dict[str, Any]]:
    """The JSON records among ``lines`` (a torn or foreign line is skipped)."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    return out


def metrics_path(run_root: str | os.PathLike, role: str) -> Path:
    return Path(run_root) / "logs" / role / "metrics.jsonl"


def read_metrics(run_root: str | os.PathLike, role: str) -> list[dict[str, Any]]:
    """All metric records of one role (tolerates a torn last line of a live writer)."""
    try:
        with open(metrics_path(run_root, role)) as f:
            return _records(f)
    except FileNotFoundError:
        return []


class MetricsTail:
    """One role's ``metrics.jsonl`` read incrementally: each :meth:`read` returns the records
    appended since the previous one, reading only the new bytes.

    A last line without its newline yet (a writer mid-line) is kept back until it is complete.
    A file that was truncated, or replaced by another one (rotated, a new run directory
    copied in: another inode, fewer bytes than already read, or different first bytes), is
    read again from its start; :attr:`restarts` counts those. A missing file reads as empty.
    """

    HEAD = 64     # first bytes remembered to notice a file rewritten in place past the old offset

    def __init__(self, run_root: str | os.PathLike, role: str):
        self.path = metrics_path(run_root, role)
        self.offset = 0           # bytes of the current file consumed (complete lines + held partial)
        self.bytes_read = 0       # total bytes read from disk, for tests and benchmarks
        self.restarts = 0
        self._ino: int | None = None
        self._head = b""
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            head = os.pread(f.fileno(), min(self.HEAD, len(self._head) or self.HEAD), 0) if self.offset else b""
            if self.offset and (st.st_ino != self._ino or st.st_size < self.offset or head != self._head):
                self.offset, self._partial, self._head = 0, b"", b""
                self.restarts += 1
            self._ino = st.st_ino
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        self.bytes_read += len(chunk)
        if len(self._head) < self.HEAD:
            self._head = (self._head + chunk)[:self.HEAD]
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        return _records(lines)
