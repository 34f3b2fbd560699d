"""Progress bars for long work (task building, evaluation, reshard, calibration), on terminals only.

One rule for every bar: it draws on stderr when stderr is a terminal and stays silent
otherwise, so batch logs, CI output and pipes get no carriage-return noise (the work logs its
own lines there). ``NEON_PROGRESS=0`` turns bars off, ``NEON_PROGRESS=1`` forces them on.
"""
from __future__ import annotations

import os
import sys
from typing import Iterable


def enabled() -> bool:
    forced = os.environ.get("NEON_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
        unit_scale: bool = False, show: bool = True):
    """A tqdm bar on stderr, drawn only when :func:`enabled` (and ``show``)."""
    from tqdm import tqdm  # deferred: heavy (tqdm)
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                disable=not (show and enabled()), dynamic_ncols=True, leave=True)
