"""Where the tests find the repository: one place, whichever tier folder a test lives in.

``tests/`` is on ``sys.path`` (``tests/conftest.py``), so any test imports ``from repo_paths import REPO``.
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def with_tests_on_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``tests/`` first on PYTHONPATH: a test file run as a script (its own ranks,
    a child measuring memory) imports the helpers of ``tests/`` from whichever tier folder it is in."""
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])))
