"""Host work beside the device: a step's micro-batches built on a background thread, in order,
while the schedule runs the earlier ones.

:class:`Prefetched` is a sequence whose item ``j`` is ``build(j)``; a thread builds them in
order from the moment it is made, and reading item ``j`` waits only until that one is built.
megatron's schedule pulls micro-batch ``j + 1`` when micro-batch ``j``'s kernels are queued,
so on CUDA the host builds (packing, the piece map, the pinned upload) while the device runs.
An error in ``build`` is raised where the item is read (the same exception), and the thread
stops.  The thread takes the caller's CUDA device (a new thread starts on device 0).
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Sequence, TypeVar

import torch

T = TypeVar("T")


class Prefetched(Sequence, Generic[T]):
    def __init__(self, n: int, build: Callable[[int], T], name: str = "neon-prefetch") -> None:
        self._n = n
        self._build = build
        self._items: list = [None] * n
        self._done = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        try:
            for j in range(self._n):
                item = self._build(j)
                with self._cond:
                    self._items[j] = item
                    self._done = j + 1
                    self._cond.notify_all()
        except BaseException as e:          # re-raised in the reader
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(self._n))]
        if not 0 <= j < self._n:
            raise IndexError(j)
        with self._cond:
            while self._done <= j and self._error is None:
                self._cond.wait()
            if self._done <= j:
                raise self._error
            return self._items[j]

    def all(self) -> list[T]:
        """Every item (waits for the thread; raises its error)."""
        out = [self[j] for j in range(self._n)]
        self._thread.join()
        return out
