"""Every test file sits in its tier (tests/README.md): ``unit/<package>/``, ``integration/``,
``system/`` or ``structure/``; none at the top of ``tests/``, and no two with the same name
(pytest's "prepend" import mode and the tests' bare-name imports of each other need that)."""

from __future__ import annotations

from collections import Counter

from repo_paths import TESTS

TIERS = ("integration", "system", "structure")


def _test_files():
    return sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_every_test_file_is_in_a_tier():
    misplaced = [str(p) for p in _test_files()
                 if not ((len(p.parts) == 2 and p.parts[0] in TIERS) or (len(p.parts) == 3 and p.parts[0] == "unit"))]
    assert not misplaced, ("test files outside the tiers (move each with `git mv` to tests/unit/<package>/ "
                           "if it starts "
                           f"no process, else tests/integration/, tests/system/ or tests/structure/: tests/README.md): "
                           f"{misplaced}")


def test_test_file_names_are_unique_across_tiers():
    twice = [name for name, n in Counter(p.name for p in _test_files()).items() if n > 1]
    assert not twice, f"test file names used in more than one tier folder (rename one): {twice}"
