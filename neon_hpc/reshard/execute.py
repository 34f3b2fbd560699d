"""Run one rank's share of a :class:`~neon_hpc.reshard.tasks.ConversionTasks`.

Per task: ``pread`` each chunk's byte range, ``torch.load(weights_only=True)`` the blob,
assemble the slab (usually the chunk itself, no copy), apply the ops, and ``pwrite`` each HF
tensor at the offset the tasks fixed inside this rank's own safetensors files.  At most one
task's chunks are alive at a time, so memory is bounded by the largest task (one expert
slab, one layer's QKV, or the embedding), not by the model.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from neon_hpc.checkpoint.metadata import Checkpoint, CheckpointError, Chunk
from neon_hpc.reshard.slabs import Slab, apply_op
from neon_hpc.reshard.tasks import ChunkTask, ConversionTasks, intersects
from neon_hpc.util.progress import bar


@dataclass
class RankStats:
    rank: int
    tasks: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    digest_reread_bytes: int = 0
    files: list[str] = field(default_factory=list)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (read_bytes/write_bytes = storage, rchar/wchar = syscalls)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}
    except OSError:
        return {}


class _Window(io.RawIOBase):
    """A read-only file view of bytes ``[start, start + length)`` of an open fd (pread based).

    torch.load reads the blob's zip records straight through it, so a chunk's bytes land once,
    in the tensor, instead of first in a bytes object and then in the tensor."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._len, self._pos = fd, start, length, 0
        self.bytes_read = 0
        self.reads: list[tuple[int, int]] = []     # (position, length) of each read, in order

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._len - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [memoryview(buf)[:n]], self._start + self._pos)
        self.reads.append((self._pos, got))
        self._pos += got
        self.bytes_read += got
        return got


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class ChunkReader:
    """Reads chunk blobs by byte range; keeps one fd per ``.distcp`` file.

    With digests (the checkpoint's ``integrity.json``, ``verify=True``) every blob is checked
    on the bytes read: torch.load reads the blob's storage record straight into the tensor
    (:class:`_Window`), and the digest runs over the blob's small zip records before it, the
    tensor's own storage bytes, and the records after it, in file order, so the payload is
    neither read nor copied twice.  A blob laid out otherwise (several records, an empty
    tensor) is read once more into one buffer and checked there."""

    def __init__(self, ckpt: Checkpoint, verify: bool = True):
        self.ckpt = ckpt
        self.digests = ckpt.digests if verify else None
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self.reread_bytes = 0      # blobs read a second time for their digest (unusual layouts, damage)

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            path = self.ckpt.path / name
            try:
                self._fds[name] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing (it vanished after the tasks were built)") from None
        return self._fds[name]

    def read(self, key: str, c: Chunk, dtype: str):
        # torch is imported where used: importing this module (the reshard CLI does) does not load it
        import torch  # deferred: heavy (torch)
        fd = self._fd(c.file)
        if os.fstat(fd).st_size < c.offset + c.length:
            raise CheckpointError(f"{self.ckpt.path / c.file} is truncated: {key}@{list(c.offsets)} needs "
                                  f"bytes [{c.offset}, {c.offset + c.length}), the file has {os.fstat(fd).st_size}")
        window = _Window(fd, c.offset, c.length)
        try:
            t = torch.load(window, weights_only=True, map_location="cpu")
        except Exception as e:
            if self.digests is not None:    # damaged bytes: say so (and which tensor), not just "unloadable"
                self._check(key, c, fd, None, window)
            raise CheckpointError(f"{self.ckpt.path / c.file}[{c.offset}:{c.offset + c.length}] ({key}@"
                                  f"{list(c.offsets)}): not a loadable torch.save blob ({e})") from e
        finally:
            self.bytes_read += window.bytes_read
        if self.digests is not None:
            self._check(key, c, fd, t, window)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != c.sizes or str(t.dtype).removeprefix("torch.") != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{self.ckpt.path / c.file}: chunk {key}@{list(c.offsets)} holds {got}, "
                                  f"metadata says {c.sizes} {dtype}; the checkpoint does not match its .metadata")
        return t

    def _check(self, key: str, c: Chunk, fd: int, t, window: _Window) -> None:
        """The blob's digest, over [records before | the tensor's storage bytes | records after]."""
        import torch  # deferred: heavy (torch)
        what = f"{key}@{list(c.offsets)}"
        storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
        n = storage.nbytes() if storage is not None else 0
        # the storage record: the last single read of exactly the storage's size
        pos = next((p for p, k in reversed(window.reads) if k == n), None) if n else None
        if pos is None:
            self.reread_bytes += c.length
            self.digests.check(c.file, c.offset, c.length, _pread_exact(fd, c.length, c.offset), what)
            return
        payload = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,))
        head = _pread_exact(fd, pos, c.offset)                        # zip records: a few hundred bytes
        tail = _pread_exact(fd, c.length - pos - n, c.offset + pos + n)
        if not self.digests.matches_parts(c.file, c.offset, c.length, (head, memoryview(payload.numpy()), tail)):
            # the authority is the file's bytes: re-read the blob whole (raises naming the tensor)
            self.reread_bytes += c.length
            self.digests.check(c.file, c.offset, c.length, _pread_exact(fd, c.length, c.offset), what)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def assemble_slab(slab: Slab, chunks: list[tuple[str, Chunk, object]]):
    """The slab as one tensor from the chunks that intersect it (a view when one chunk covers it)."""
    import torch  # deferred: heavy (torch)
    n = len(slab.index)
    mine = [(c, t) for key, c, t in chunks if key == slab.key
            and all(o <= i < o + s for i, o, s in zip(slab.index, c.offsets, c.sizes))]
    lead_of = lambda c: tuple(i - o for i, o in zip(slab.index, c.offsets))  # noqa: E731
    if len(mine) == 1 and mine[0][0].sizes[n:] == slab.shape:
        c, t = mine[0]
        return t[lead_of(c)]
    out = torch.empty(slab.shape, dtype=mine[0][1].dtype)
    for c, t in mine:
        dst = tuple(slice(o, o + s) for o, s in zip(c.offsets[n:], c.sizes[n:]))
        out[dst] = t[lead_of(c)]
    return out


def tensor_bytes(t) -> memoryview:
    import torch  # deferred: heavy (torch)
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class WriteBehind:
    """Start the kernel's writeback of our output every ``every`` bytes, so the final fsync
    finds little left to flush and writing overlaps reading (Linux: fadvise DONTNEED on dirty
    pages starts their writeback without waiting; clean pages also leave the page cache)."""

    def __init__(self, fds: dict[str, int], every: int = 64 << 20):
        self.fds, self.every, self.pending = fds, every, 0

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.every and hasattr(os, "posix_fadvise"):
            for fd in self.fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self.pending = 0


class Progress:
    """Rank 0's progress bar over the bytes of its share (``neon_hpc.util.progress``: terminals only)."""

    def __init__(self, total_bytes: int, enabled: bool, label: str = "reshard"):
        self._bar = bar(total=max(total_bytes, 1), desc=label, unit="B", unit_scale=True, show=enabled)

    def add(self, n: int) -> None:
        self._bar.update(n)

    def finish(self) -> None:
        self._bar.close()


def run_rank(work: ConversionTasks, rank: int, staging: Path, show_progress: bool = False,
             verify_digests: bool = True) -> RankStats:
    """Write this rank's safetensors files into ``staging``; returns its stats.  ``verify_digests``:
    check every chunk read against the checkpoint's digests (when it has them)."""
    with one_thread():
        return _run_rank(work, rank, staging, show_progress, verify_digests)


@contextlib.contextmanager
def one_thread():
    """Parallelism comes from ranks; torch's intra-op threads only spin against each other (and
    the other ranks on the same cores) for plain copies.  Restored after, so an in-process
    caller (the trainer) keeps its own setting."""
    import torch  # deferred: heavy (torch)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_rank(work: ConversionTasks, rank: int, staging: Path, show_progress: bool, verify_digests: bool) -> RankStats:
    t0 = time.monotonic()
    stats = RankStats(rank)
    fds = _open_shards(work, rank, staging)
    reader = ChunkReader(work.ckpt, verify=verify_digests)
    tasks = work.tasks_of(rank)
    progress = Progress(sum(t.read_bytes + t.write_bytes for t in tasks), show_progress)
    try:
        flusher = WriteBehind(fds)
        for task in tasks:
            written = _run_task(work, task, reader, fds)
            flusher.wrote(written)
            stats.tasks += 1
            stats.write_bytes += written
            progress.add(task.read_bytes + written)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
        reader.close()
        progress.finish()
    stats.read_bytes = reader.bytes_read
    stats.digest_reread_bytes = reader.reread_bytes
    stats.write_bytes += sum(len(s.header) for s in work.shards_of(rank))
    stats.seconds = time.monotonic() - t0
    stats.peak_rss_bytes = peak_rss_bytes()
    stats.files = [s.name for s in work.shards_of(rank)]
    return stats


def _open_shards(work: ConversionTasks, rank: int, staging: Path) -> dict[str, int]:
    fds = {}
    for s in work.shards_of(rank):
        fd = os.open(staging / s.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, s.size)
        pwrite_all(fd, memoryview(s.header), 0)
        fds[s.name] = fd
    return fds


def _run_task(work: ConversionTasks, task: ChunkTask, reader: ChunkReader, fds: dict[str, int]) -> int:
    dtypes = {s.key: s.dtype for s in task.slabs}
    if task.streamable:
        return _stream_task(work, task, reader, fds, dtypes)
    loaded = [(key, c, reader.read(key, c, dtypes[key])) for key, c in task.chunks]
    written = 0
    for slab in task.slabs:
        src = assemble_slab(slab, loaded)
        for o in slab.outputs:
            data = tensor_bytes(apply_op(o.op, src))
            fname, offset = work.location[o.name]
            pwrite_all(fds[fname], data, offset)
            written += len(data)
    return written


def _row_range(op, rows: int) -> tuple[int, int]:
    return op.args if op.kind == "rows" else (0, rows)


def _stream_task(work: ConversionTasks, task: ChunkTask, reader: ChunkReader, fds: dict[str, int],
                 dtypes: dict[str, str]) -> int:
    """Read one chunk at a time and write its rows straight into every output they belong to."""
    written = 0
    for key, c in task.chunks:
        t = reader.read(key, c, dtypes[key])
        for slab in task.slabs:
            if slab.key != key or not intersects(slab, c):
                continue
            n = len(slab.index)
            piece = t[tuple(i - o for i, o in zip(slab.index, c.offsets))]     # [chunk rows, ...]
            r0, r1 = c.offsets[n], c.offsets[n] + c.sizes[n]
            for o in slab.outputs:
                a, b = _row_range(o.op, slab.shape[0])
                lo, hi = max(a, r0), min(b, r1)
                if lo >= hi:
                    continue
                data = tensor_bytes(piece[lo - r0:hi - r0])
                row_bytes = len(data) // (hi - lo)
                fname, offset = work.location[o.name]
                pwrite_all(fds[fname], data, offset + (lo - a) * row_bytes)
                written += len(data)
        del t
    return written
