"""Read-ahead of the next claim's shards (``store.read_ahead``): the trainer's claim I/O beside its step.

A claim takes the oldest shards in ``ready/`` until it keeps ``want`` trajectories, and reads
and validates each one it moves (:func:`~neon_hpc.store.reader.read_shard`): on the step's
critical path, between one step and the next.  :class:`ReadAhead` reads those same shards
earlier, on a thread, while the current step trains: :meth:`start` (after a claim) begins
reading the oldest ready shards whose names add up to ``want`` trajectories (names carry the
count), polling ``ready/`` for new ones until that many are held or :meth:`stop`.  The claim
then reads through :meth:`read`: a shard held for the same file (the rename into the claim
directory keeps its inode, size and modification time) comes from memory, anything else is read
as before.  Nothing about what is claimed changes: which shards, in which order, what is kept,
dropped or quarantined is the claim's decision, on the same bytes; a shard the read-ahead
found invalid is not held, so the claim reads it itself and quarantines it as it would.  Every
rank runs one (the others read the committed claim back through it).  Held shards are used
once; a held shard that left ``ready/`` some other way is forgotten at the next :meth:`start`.
Memory: at most one step's claim beyond the step's own.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

from neon_hpc.store import schema as S
from neon_hpc.store.reader import ShardError, read_shard
from neon_hpc.store.trajectory import Trajectory


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ReadAhead:
    def __init__(self, ready_dir: Path, list_ready: Callable[[], list[str]], poll_s: float = 0.2) -> None:
        self.ready_dir, self.list_ready, self.poll_s = Path(ready_dir), list_ready, poll_s
        self._held: dict[str, tuple[tuple, list[Trajectory]]] = {}    # name -> (file identity, trajectories)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = self.misses = 0

    def start(self, want: int) -> None:
        """Begin holding the shards the next claim of ``want`` trajectories would take first."""
        self.stop()
        ready = set(self.list_ready())
        with self._lock:     # shards that left ready/ unclaimed by us (another consumer, quarantine)
            for name in [n for n in self._held if n not in ready]:
                del self._held[name]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(want,), name="neon-read-ahead", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def read(self, path: str | os.PathLike) -> list[Trajectory]:
        """The shard at ``path``: from memory when held for this very file, else :func:`read_shard`."""
        path = Path(path)
        with self._lock:
            held = self._held.pop(path.name, None)
        if held is not None and held[0] == _identity(path):
            self.hits += 1
            return held[1]
        self.misses += 1
        return read_shard(path)

    def _run(self, want: int) -> None:
        while not self._stop.is_set():
            count = 0
            for name in self.list_ready():
                if self._stop.is_set() or count >= want:
                    break
                sn = S.parse_shard_name(name)
                count += sn.num_trajectories if sn is not None else 1
                with self._lock:
                    if name in self._held:
                        continue
                path = self.ready_dir / name
                ident = _identity(path)
                try:
                    trajs = read_shard(path)
                except (ShardError, FileNotFoundError):
                    continue             # claimed meanwhile, or invalid: the claim reads it itself
                if ident is None or _identity(path) != ident:
                    continue             # moved or replaced while being read
                with self._lock:
                    self._held[name] = (ident, trajs)
            if count >= want:
                return
            self._stop.wait(self.poll_s)
