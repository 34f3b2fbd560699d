"""``ruff check`` is clean over the repository, with the rules of ``[tool.ruff]`` in pyproject.toml
(unused and undefined names, redefinitions, syntax errors, import placement, whitespace, line length)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from repo_paths import REPO


def _ruff() -> list[str]:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed: it comes with the test extra (`pip install -e '.[test]'`, "
                    "which `bash env/setup.sh` runs)")
    return [exe]


def test_ruff_check_is_clean():
    r = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, ("`ruff check` reports (fix them, or say in [tool.ruff] of pyproject.toml "
                               f"why a rule does not apply):\n{r.stdout}{r.stderr}")
