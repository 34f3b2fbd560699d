"""Every third-party package the library and tools import is declared in pyproject.toml.

Read from the source (every ``import``/``from`` statement, parsed with ``ast``), mapped to the
distribution that provides it in this venv (``importlib.metadata.packages_distributions``),
and compared with ``[project] dependencies`` + the ``test`` extra: an undeclared import works
here and breaks on a fresh machine, which is what this test exists to catch.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions

from repo_paths import REPO


def _declared() -> set[str]:
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"]) + [r for extra in proj.get("optional-dependencies", {}).values() for r in extra]
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def _imported_top_levels(paths) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                found.setdefault(n.split(".")[0], str(path.relative_to(REPO)))
    return found


def test_every_imported_third_party_package_is_declared():
    sources = sorted((REPO / "neon_hpc").rglob("*.py")) + sorted((REPO / "tools").glob("*.py"))
    imported = _imported_top_levels(sources)
    dists = packages_distributions()
    # the library, and the scripts in tools/ that import each other (benchlib, chaos, ...)
    ours = {"neon_hpc"} | {p.stem for p in (REPO / "tools").glob("*.py")}
    missing = []
    for mod, where in sorted(imported.items()):
        if mod in ours or mod in sys.stdlib_module_names:
            continue
        provided_by = {d.lower().replace("_", "-") for d in dists.get(mod, [])}
        if not provided_by:
            missing.append(f"{mod} (imported in {where}; not installed here either)")
        elif not provided_by & _declared():
            missing.append(f"{mod} (imported in {where}; provided by {sorted(provided_by)})")
    assert not missing, "undeclared imports; add them to pyproject.toml dependencies:\n  " + "\n  ".join(missing)


# blocks every module an optional extra provides, as on a node that installed `neon-hpc` alone
_BLOCK = '''
import sys
from importlib.abc import MetaPathFinder
from neon_hpc.util import extras
BLOCKED = set(extras.extra_of())
class Block(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0].replace("_", "-") in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
'''


def _without_extras(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code, *args], capture_output=True, text=True, cwd=REPO)


def test_the_extras_are_the_optional_groups_of_pyproject():
    from neon_hpc.util import extras
    groups = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras.extra_of().values()) == set(groups) - {"all", "test"}
    assert {"simpy", "pymatgen", "psycopg", "openai", "wandb", "tensorboard"} <= set(extras.extra_of())


def test_a_trainer_or_rollout_node_needs_no_extra():
    """The roles' modules, the launcher, reshard and the config load with every extra's module missing."""
    r = _without_extras(
        "import neon_hpc.train.loop, neon_hpc.train.__main__, neon_hpc.rollout.worker, neon_hpc.rollout.node, "
        "neon_hpc.launch.roles, neon_hpc.launch.common, neon_hpc.reshard.cli\n"
        "from neon_hpc import config\nfrom neon_hpc.train.sections import TrainerSections\n"
        f"TrainerSections.of(config.load({str(REPO / 'configs' / 'tiny_cpu.yaml')!r}))\nprint('OK')\n")
    assert r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_a_command_that_needs_an_extra_names_it():
    r = _without_extras("from neon_hpc.cli import main\nraise SystemExit(main(sys.argv[1:]))\n",
                        "plan", "simulate", str(REPO / "configs" / "tiny_cpu.yaml"))
    assert r.returncode == 3 and "pip install 'neon-hpc[plan]'" in r.stderr, r.stdout + r.stderr
