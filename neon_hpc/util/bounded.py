"""Bounded text: what echoes outside input (error messages, tool results, engine error
bodies, log lines) is capped here, with an explicit truncation marker.

A 10 MB tool name or a million-key argument object must not come back whole: into a
model's context, a log file, or an HTTP error body.  The marker says how much was cut, so a
reader knows the text is not the whole.  This module imports nothing of neon_hpc.
"""

from __future__ import annotations

from typing import Any

REPR_CAP = 200        # characters of a bad value quoted inside a message
MESSAGE_CAP = 2000    # characters of one error message (engine error bodies, tool errors)
LOG_LINE_CAP = 8192   # characters of one log message (logs.RoleLogger)
MARKER = "...[truncated {n} chars]"


def clip_text(text: str, limit: int, marker: str = MARKER) -> str:
    """``text`` cut to at most ``limit`` characters, ending with an explicit truncation marker.

    The one place that bounds text which echoes outside input (error messages, tool results,
    log lines): the marker says how much was cut, so a reader knows it is not the whole.
    """
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(marker.format(n=len(text))))   # n never has more digits than len(text)
    return text[:keep] + marker.format(n=len(text) - keep)


def short_repr(value: Any, limit: int = REPR_CAP) -> str:
    """``repr(value)``, bounded (a 10 MB string must not come back whole inside an error)."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        # never build the whole repr of a huge string; count what is cut in the value's own units
        keep = max(0, limit - len(MARKER.format(n=len(value))) - 3)
        return repr(value[:keep]) + MARKER.format(n=len(value) - keep)
    if isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    return clip_text(repr(value), limit)


