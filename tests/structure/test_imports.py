"""Imports sit at module top; an import inside a function says why it waits (issue 32 item 5).

Every ``import`` and ``from ... import`` nested in a function (at any depth, methods and
closures too) of a module of ``neon_hpc/`` carries a marker of one fixed form::

    # deferred: <kind> (<what>)

with ``<kind>`` one of

``heavy``     a package this module's import does not load today (torch, megatron,
              transformers, scipy, pymatgen, matplotlib, numpy, pydantic, ...), or a module
              of neon_hpc that loads one: deferring it keeps ``neon-hpc --help``, the config
              check and the light tools light;
``cycle``     the imported module imports this one at its top (name it);
``optional``  used only when a feature is switched on (a metrics sink, a database, MPI) or
              when a package may be missing (the code catches the ``ImportError``).

The marker sits on the import's first line (after the code) or alone on the line right
before it.  A marker line right before a run of consecutive import statements (no blank or
other line between them) covers the whole run.  A marker that covers no import is stale and
fails too.  Everything else belongs at module top: a cheap standard-library module, a
package the module loads anyway, a module of neon_hpc that brings no heavy package along
and makes no cycle.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from pyscan import in_function_imports
from repo_paths import REPO

LIB = REPO / "neon_hpc"
KINDS = ("heavy", "cycle", "optional")
MARKER = re.compile(r"#\s*deferred:\s*(?P<kind>\w+)\s*\((?P<what>[^)]+)\)")
STANDALONE = re.compile(r"^\s*#\s*deferred:")


def _siblings(tree: ast.AST) -> dict[int, ast.stmt | None]:
    """id(statement) -> the statement right before it in the same body (None when first)."""
    prev: dict[int, ast.stmt | None] = {}
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list):
                for i, st in enumerate(body):
                    prev[id(st)] = body[i - 1] if i else None
        for h in getattr(node, "handlers", []) or []:
            for i, st in enumerate(h.body):
                prev[id(st)] = h.body[i - 1] if i else None
    return prev


def check_source(src: str) -> tuple[list[tuple[int, str]], list[int]]:
    """(problems as (line, why), lines of the marker comments used) for one module's source."""
    lines = src.splitlines()
    tree = ast.parse(src)
    prev = _siblings(tree)
    problems: list[tuple[int, str]] = []
    used: list[int] = []
    for node in in_function_imports(tree):
        first = node.lineno
        # the run of consecutive import statements this one closes (each starting right below the last)
        head = node
        while True:
            p = prev.get(id(head))
            if isinstance(p, (ast.Import, ast.ImportFrom)) and p.end_lineno == head.lineno - 1:
                head = p
            else:
                break
        own = MARKER.search(lines[first - 1])
        above = lines[head.lineno - 2] if head.lineno >= 2 else ""
        lead = MARKER.search(above) if STANDALONE.match(above) else None
        found = own or lead
        if found is None:
            problems.append((first, f"in-function import without a '# deferred: <kind> (<what>)' marker: "
                                    f"{lines[first - 1].strip()}"))
            continue
        used.append(first if own else head.lineno - 1)
        if found["kind"] not in KINDS:
            problems.append((first, f"marker kind {found['kind']!r}; one of {', '.join(KINDS)}"))
    return problems, used


def stale_markers(src: str, used: list[int]) -> list[int]:
    return [i for i, line in enumerate(src.splitlines(), 1) if MARKER.search(line) and i not in set(used)]


def test_every_in_function_import_says_why_it_is_deferred():
    bad = []
    for path in sorted(LIB.rglob("*.py")):
        src = path.read_text()
        problems, used = check_source(src)
        rel = path.relative_to(REPO)
        bad += [f"{rel}:{line}: {why}" for line, why in problems]
        bad += [f"{rel}:{line}: stale marker (no in-function import below or on it)"
                for line in stale_markers(src, used)]
    assert not bad, "\n".join(bad)


def test_the_rule_as_the_docstring_states_it():
    """The checker itself: what passes and what fails."""
    src = (
        "import os\n"
        "def a():\n"
        "    import torch  # deferred: heavy (torch)\n"
        "def b():\n"
        "    # deferred: heavy (megatron)\n"
        "    from megatron.core import parallel_state\n"
        "    from megatron.core import tensor_parallel\n"
        "def c():\n"
        "    import json\n"
        "def d():\n"
        "    # deferred: heavy (torch)\n"
        "    import torch\n"
        "\n"
        "    import scipy\n"
        "def e():\n"
        "    import wandb  # deferred: lazy (wandb)\n"
        "# deferred: cycle (nothing below)\n"
        "x = 1\n"
    )
    problems, used = check_source(src)
    assert [line for line, _ in problems] == [9, 14, 16], problems
    assert "marker kind 'lazy'" in problems[2][1]
    assert stale_markers(src, used) == [17]


def test_cli_help_and_config_check_stay_light():
    """``neon-hpc --help`` loads neither torch nor megatron; the config check loads no megatron."""
    code = ("import runpy, sys; sys.argv = ['neon-hpc'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('neon_hpc.cli', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('LOADED', sorted(m for m in ('torch', 'megatron') if m in sys.modules))\n")
    loaded = {}
    for args in (["--help"], ["config", "check", str(REPO / "configs" / "tiny_cpu.yaml")]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO)
        line = [x for x in r.stdout.splitlines() if x.startswith("LOADED")]
        assert line, r.stdout + r.stderr
        loaded[args[0]] = line[-1]
    assert loaded["--help"] == "LOADED []", loaded
    assert "megatron" not in loaded["config"], loaded


def test_the_config_package_is_a_leaf():
    """``import neon_hpc.config`` (every section, the cross rules, the loader) and loading the default
    config load no h5py, numpy, torch or megatron: a launcher, a login node or ``config check``
    reads a config without the science or the trainer's stack."""
    code = ("import sys, neon_hpc.config as c; c.load(None)\n"
            "print('LOADED', sorted({m.split('.')[0] for m in sys.modules}"
            " & {'h5py', 'numpy', 'torch', 'megatron'}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "LOADED []" in r.stdout, r.stdout + r.stderr
