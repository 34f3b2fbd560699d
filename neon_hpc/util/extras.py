"""Which optional dependency group (``pip install 'neon-hpc[<extra>]'``) provides a missing module.

The groups are declared once, in ``pyproject.toml``'s ``[project.optional-dependencies]`` (what
each part needs beyond the roles' core: the XRD science, PostgreSQL, the agent's OpenAI client,
the planner's simulator, plots, metrics sinks); this module reads them from the installed
package's metadata, so a trainer node installs ``neon-hpc`` alone and a command that needs more
says which extra to add instead of a bare ``No module named 'simpy'``.
"""
from __future__ import annotations

import functools
import re
from importlib import metadata

DIST = "neon-hpc"


@functools.cache
def extra_of() -> dict[str, str]:
    """``{requirement name: extra}`` for every optional group but ``all`` and ``test`` (empty when the
    package's metadata cannot be read: a checkout used without installing it)."""
    try:
        reqs = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return {}
    out: dict[str, str] = {}
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+).*;\s*extra\s*==\s*\"([^\"]+)\"", r)
        if m and m.group(2) not in ("all", "test") and m.group(1) != DIST:
            out.setdefault(m.group(1).lower().replace("_", "-"), m.group(2))
    return out


def hint(exc: BaseException) -> str | None:
    """For a :class:`ModuleNotFoundError` of a module an extra provides, what to install; else None."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    extra = extra_of().get(top.lower().replace("_", "-"))
    if extra is None:
        return None
    return f"{top} is not installed: it comes with the extra {extra!r}: pip install 'neon-hpc[{extra}]'"
