"""The trainer's heap between steps: freed heap memory goes back to the OS, and a diagnostic.

**Trim.** After a step the trainer calls glibc's ``malloc_trim(0)``, at most once every
``TRIM_EVERY_S`` (2 s: after every step of a slow step, every tenth of a 0.2 s one, so the
milliseconds it costs stay near 1% of the loop or under, and RSS still follows within seconds). Why: the trainer has
~70 threads (gloo's per-process-group loops, torch's pools) and glibc gives threads up to
8 x cores malloc arenas. A step frees almost all it allocates, but the freed chunks stay inside
the arenas, and where the next step's allocations land differs from step to step, so the
arenas' footprint (RSS) wobbles by tens of MB and ratchets up to a new high-water mark now and
then, while the bytes in use stay flat (the soak of issue 20 saw one +13 MB step after 23 min;
``NEON_TRAIN_MEMDEBUG`` below showed in use ~158 MB flat, free-in-arenas 55 -> 97 MB).
``malloc_trim(0)`` returns every whole free page of every arena (madvise), so RSS follows what
is in use. It costs milliseconds (``trim_ms`` in the diagnostic); without glibc
(musl, macOS) it is skipped. ``NEON_TRAIN_MALLOC_TRIM=0`` turns it off (to compare).

**Diagnostic.** ``NEON_TRAIN_MEMDEBUG=N`` (N >= 1): after every N-th step each trainer rank
appends one JSON line to ``logs/trainer/memdebug_<rank>.jsonl``::

    {"step", "time", "rss_kb", "anon_kb"          /proc/self/smaps_rollup Rss, Anonymous
     "malloc": {"arena_kb", "mmap_kb", "used_kb", "free_kb", "heaps"}   glibc: mallinfo2 (summed
                                   over arenas; free_kb counts free chunks whether their pages are
                                   resident or were given back) and the number of arena heaps
     "threads",                    OS threads of the process (/proc/self/task)
     "gc": [g0, g1, g2], "gc_objects", "max_seq", "packed_tokens", "max_seq_seen",
     "trimmed", "trim_ms",         whether malloc_trim ran after this step, and its time (null: not
                                   this step, the last trim was under TRIM_EVERY_S ago)
     "tracemalloc": [[where, +KiB, count], ...]}      only with NEON_TRAIN_MEMDEBUG_TRACE=F (frames
                                   per traceback, >= 1): the 8 largest growths since the previous line

Neither changes what the trainer computes. Unset or 0: nothing is recorded.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

EVERY_ENV = "NEON_TRAIN_MEMDEBUG"
TRACE_ENV = "NEON_TRAIN_MEMDEBUG_TRACE"
TRIM_ENV = "NEON_TRAIN_MALLOC_TRIM"
TRIM_EVERY_S = 2.0   # the shortest interval between two trims (module docstring)


def _env_int(name: str, default: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number (0: off)") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected 0 (off) or a positive number")
    return value


def smaps_rollup() -> dict[str, int]:
    """Rss and Anonymous (kB) of this process, from ``/proc/self/smaps_rollup``."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous"):
                out[key] = int(rest.split()[0])
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def glibc():
    """glibc as a ctypes library, or None where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def malloc_stats(libc) -> dict[str, int] | None:
    """glibc's view: bytes in arenas, in mmapped blocks, in use, free inside arenas; arena heaps."""
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    out = {"arena_kb": mi.arena // 1024, "mmap_kb": mi.hblkhd // 1024, "used_kb": mi.uordblks // 1024,
           "free_kb": mi.fordblks // 1024}
    if hasattr(libc, "malloc_info") and hasattr(libc, "fopen"):
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
            fp = libc.fopen(tmp.name.encode(), b"w")
            if fp:
                libc.malloc_info(0, fp)
                libc.fclose(fp)
                out["heaps"] = Path(tmp.name).read_text().count("<heap nr=")
    return out


class StepHeap:
    """Called after every step: trims (unless turned off), records every N-th step (if asked)."""

    def __init__(self, path: Path, every: int = 0, trace: int = 0, trim: bool = True):
        self.path, self.every, self.trace = path, every, trace
        self._libc = glibc()
        self.trim = trim and self._libc is not None
        self._trimmed_at: float | None = None     # monotonic time of the last trim
        self._snap = None
        self.max_seq_seen = 0
        if trace:
            tracemalloc.start(trace)
            self._snap = tracemalloc.take_snapshot()

    @classmethod
    def from_env(cls, log_dir: Path, rank: int) -> "StepHeap":
        return cls(Path(log_dir) / f"memdebug_{rank}.jsonl", _env_int(EVERY_ENV), _env_int(TRACE_ENV),
                   _env_int(TRIM_ENV, default=1) > 0)

    def after_step(self, step: int, lengths: list[int]) -> None:
        trim_ms = None
        now = time.monotonic()
        if self.trim and (self._trimmed_at is None or now - self._trimmed_at >= TRIM_EVERY_S):
            t0 = time.perf_counter()
            self._libc.malloc_trim(0)
            trim_ms = round((time.perf_counter() - t0) * 1e3, 2)
            self._trimmed_at = now
        if self.every == 0:
            return
        max_seq = max(lengths, default=0)
        self.max_seq_seen = max(self.max_seq_seen, max_seq)
        if step % self.every:
            return
        mem = smaps_rollup()
        rec = {"step": step, "time": round(time.time(), 2), "rss_kb": mem.get("Rss"), "anon_kb": mem.get("Anonymous"),
               "malloc": malloc_stats(self._libc), "threads": len(os.listdir("/proc/self/task")),
               "gc": list(gc.get_count()), "gc_objects": len(gc.get_objects()), "max_seq": max_seq,
               "packed_tokens": int(sum(lengths)), "max_seq_seen": self.max_seq_seen, "trimmed": trim_ms is not None,
               "trim_ms": trim_ms}
        if self.trace:
            snap = tracemalloc.take_snapshot()
            top = snap.compare_to(self._snap, "traceback")[:8]
            rec["tracemalloc"] = [[str(s.traceback[0]) if s.traceback else "?", round(s.size_diff / 1024, 1),
                                   s.count_diff] for s in top]
            self._snap = snap
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line: peak RSS cannot be measured on this OS")


M_MMAP_THRESHOLD = -3            # glibc mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 64 * 1024


def mmap_large_allocations():
    """glibc: serve every allocation of 64 KiB or more with its own mmap from now on; returns the
    library.  A freed tensor then leaves the resident set at once, so a peak follows the tensors
    alive rather than the arenas' high-water mark (repeated measurements agree to ~0.1 MiB; they
    differed by up to 2x without).  Steps get slower (a page fault per new page): time before
    measuring memory.  RuntimeError where malloc is not glibc's."""
    libc = glibc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        raise RuntimeError("the CPU memory measurement needs glibc's malloc (mallopt, malloc_trim) to make "
                           "the resident set follow the tensors; run it on glibc Linux, or pass --no-memory")
    return libc


class PeakMemory:
    """Peak memory over a span of work, on the device it runs on (calibration, benchmarks, tests).

    CUDA: ``torch.cuda.max_memory_allocated`` since :meth:`start` (tensors only, not the caching
    allocator's reserve: what decides out-of-memory); ``base`` is ``memory_allocated`` then.
    CPU: the process's peak resident set (``VmHWM``, reset to the current RSS through
    ``/proc/self/clear_refs`` at :meth:`start`, after glibc's free pages went back to the OS);
    ``base`` is the RSS then.  ``mmap_large=True`` also makes glibc map large allocations on their
    own (:func:`mmap_large_allocations`), for measurements that must repeat to the page.
    ``start()`` / ``stop()`` return bytes; as a context manager ``base`` and ``peak`` are set."""

    def __init__(self, cuda: bool, mmap_large: bool = False) -> None:
        self.cuda = cuda
        self.peak = self.base = 0
        self._libc = None if cuda else (mmap_large_allocations() if mmap_large else glibc())

    def start(self) -> int:
        import torch  # deferred: heavy (torch)
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self.base
        if self._libc is not None:
            self._libc.malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")             # reset the peak RSS to the current RSS (Linux >= 4.0)
        except OSError as e:
            raise RuntimeError(f"cannot reset the peak RSS (/proc/self/clear_refs: {e.strerror}); measure "
                               f"memory on Linux") from None
        self.base = _status_bytes("VmRSS")
        return self.base

    def stop(self) -> int:
        import torch  # deferred: heavy (torch)
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = _status_bytes("VmHWM")
        return self.peak

    def __enter__(self) -> "PeakMemory":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
