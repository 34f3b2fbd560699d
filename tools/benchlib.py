"""Helpers shared by the tools/bench_*.py scripts (imported from the script's own folder)."""

from __future__ import annotations

import os


def drop_cache(paths) -> None:
    """Flush and evict files from the page cache, so the next read comes from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------
# an aten-op census (counts what a piece of code dispatches, on any device)

# ops that make the host wait for a device: a scalar read back (item/float/bool/int), and ops
# whose output size depends on the data (the host must learn it)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim",
            "repeat_interleave", "bincount", "histc")


# views and metadata: no kernel, no memory traffic (not counted by ``per_tensor``)
VIEW_OPS = frozenset(("detach", "alias", "view", "_reshape_alias", "as_strided", "t", "transpose", "unsqueeze",
                      "squeeze", "expand", "select", "slice", "permute", "split", "split_with_sizes", "unbind",
                      "chunk", "narrow", "reshape", "_unsafe_view", "lift_fresh"))


class OpCensus:
    """Count the aten ops dispatched inside ``with OpCensus() as c:`` (``c.counts[name]``).

    ``c.syncs``: ops that would synchronise a CUDA device (:data:`SYNC_OPS`, plus copies from
    a CUDA tensor to the CPU); on CPU the same ops are counted, so a CPU run says what a CUDA
    run would wait for.  ``c.per_tensor(n)``: the calls of ops issued at least ``n`` times
    (``n`` = the parameter tensors: a per-parameter loop), views aside."""

    def __init__(self) -> None:
        from collections import Counter
        self.counts: Counter = Counter()
        self.d2h = 0
        self._mode = None

    def __enter__(self) -> "OpCensus":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                census.counts[name] += 1
                if name in ("_to_copy", "copy_") and census._is_d2h(func, args, kwargs or {}):
                    census.d2h += 1
                return func(*args, **(kwargs or {}))

        self._torch = torch
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _is_d2h(self, func, args, kwargs) -> bool:
        torch = self._torch
        src = args[1] if func.__name__.startswith("copy_") and len(args) > 1 else (args[0] if args else None)
        if not isinstance(src, torch.Tensor) or not src.is_cuda:
            return False
        if func.__name__.startswith("copy_"):
            return not args[0].is_cuda
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu"

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def syncs(self) -> int:
        return sum(self.counts[n] for n in SYNC_OPS) + self.d2h

    def per_tensor(self, n: int) -> int:
        return sum(c for name, c in self.counts.items() if c >= n and name not in VIEW_OPS) if n > 1 else 0
