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

