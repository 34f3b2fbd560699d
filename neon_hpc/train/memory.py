"""The trainer's memory between steps: freed heap memory goes back to the OS, and a diagnostic.

**Trim.** After every step the trainer calls glibc's ``malloc_trim(0)``. Why: the trainer has
~70 threads (gloo's per-process-group loops, torch's pools) and glibc gives threads up to
8 x cores malloc arenas. A step frees almost all it allocates, but the freed chunks stay inside
the arenas, and where the next step's allocations land differs from step to step, so the
arenas' footprint (RSS) wobbles by tens of MB and ratchets up to a new high-water mark now and
then, while the bytes in use stay flat (the soak of issue 20 saw one +13 MB step after 23 min;
``NEON_TRAIN_MEMDEBUG`` below showed in use ~158 MB flat, free-in-arenas 55 -> 97 MB).
``malloc_trim(0)`` returns every whole free page of every arena (madvise), so RSS follows what
is in use. It costs milliseconds per step (``trim_ms`` in the diagnostic); without glibc
(musl, macOS) it is skipped. ``NEON_TRAIN_MALLOC_TRIM=0`` turns it off (to compare).

**Diagnostic.** ``NEON_TRAIN_MEMDEBUG=N`` (N >= 1): after every N-th step each trainer rank
appends one JSON line to ``logs/trainer/memdebug_<rank>.jsonl``::

    {"step", "time", "rss_kb", "anon_kb"          /proc/self/smaps_rollup Rss, Anonymous
     "malloc": {"arena_kb", "mmap_kb", "used_kb", "free_kb", "heaps"}   glibc: mallinfo2 (summed
                                   over arenas; free_kb counts free chunks whether their pages are
                                   resident or were given back) and the number of arena heaps
     "threads",                    OS threads of the process (/proc/self/task)
     "gc": [g0, g1, g2], "gc_objects", "max_seq", "packed_tokens", "max_seq_seen",
     "trimmed", "trim_ms",         whether malloc_trim ran after this step, and its time
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
from pathlib import Path

EVERY_ENV = "NEON_TRAIN_MEMDEBUG"
TRACE_ENV = "NEON_TRAIN_MEMDEBUG_TRACE"
TRIM_ENV = "NEON_TRAIN_MALLOC_TRIM"


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


class StepMemory:
    """Called after every step: trims (unless turned off), records every N-th step (if asked)."""

    def __init__(self, path: Path, every: int = 0, trace: int = 0, trim: bool = True):
        self.path, self.every, self.trace = path, every, trace
        self._libc = glibc()
        self.trim = trim and self._libc is not None
        self._snap = None
        self.max_seq_seen = 0
        if trace:
            import tracemalloc
            tracemalloc.start(trace)
            self._snap = tracemalloc.take_snapshot()

    @classmethod
    def from_env(cls, log_dir: Path, rank: int) -> "StepMemory":
        return cls(Path(log_dir) / f"memdebug_{rank}.jsonl", _env_int(EVERY_ENV), _env_int(TRACE_ENV),
                   _env_int(TRIM_ENV, default=1) > 0)

    def after_step(self, step: int, lengths: list[int]) -> None:
        trim_ms = None
        if self.trim:
            t0 = time.perf_counter()
            self._libc.malloc_trim(0)
            trim_ms = round((time.perf_counter() - t0) * 1e3, 2)
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
               "packed_tokens": int(sum(lengths)), "max_seq_seen": self.max_seq_seen, "trimmed": self.trim,
               "trim_ms": trim_ms}
        if self.trace:
            import tracemalloc
            snap = tracemalloc.take_snapshot()
            top = snap.compare_to(self._snap, "traceback")[:8]
            rec["tracemalloc"] = [[str(s.traceback[0]) if s.traceback else "?", round(s.size_diff / 1024, 1),
                                   s.count_diff] for s in top]
            self._snap = snap
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class PeakMemory:
    """Peak memory over a span of work, on the device it runs on (benchmarks and tests).

    CUDA: ``torch.cuda.max_memory_allocated`` since the span started (the allocator's bytes in
    use: what decides out-of-memory).  CPU: the process's resident set, sampled every
    ``interval_s`` by a thread (``/proc/self/statm``), after glibc's free pages went back to the
    OS at the start (:func:`glibc` ``malloc_trim``), so a span's peak is not an earlier span's
    high-water mark; ``base`` is the RSS when the span started.  Use as a context manager;
    ``peak`` and ``base`` are bytes."""

    def __init__(self, cuda: bool, interval_s: float = 0.002) -> None:
        self.cuda, self.interval_s = cuda, interval_s
        self.peak = self.base = 0
        self._stop = None

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "PeakMemory":
        import threading

        import torch
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        libc = glibc()
        if libc is not None:
            libc.malloc_trim(0)
        self.base = self.peak = self.rss()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(self.interval_s):
                self.peak = max(self.peak, self.rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
