"""Dependency direction: which part of neon_hpc may import which (issue 23 item 5).

Every import in every module of ``neon_hpc/`` is read from its syntax tree (``import``,
``from ... import``, at any depth, lazy ones inside functions too, and ``importlib.import_module``
/ ``__import__`` with a literal name), mapped to the *part* it names, and checked against the
layer table below.  A part may import parts of a lower layer only; parts of one layer do not
import each other (the foundation excepted: small shared helpers).  On top of the layers:

* ``reshard`` is a post-run tool and imports nothing of the trainer, the models or the rollout;
* ``balance`` is metadata in, assignment out: it imports no torch (checked below); fitting its cost
  model to the trainer's timed step is the trainer's (``neon_hpc/train/costfit/``);
* ``checkpoint`` (the torch_dist checkpoint format: ``.metadata`` read by an allowlist unpickler,
  ``integrity.json``, the ``config.json`` a checkpoint carries) is what the trainer and reshard both
  read; it sits below both (and below the models) and imports the foundation only;
* the megatron <-> HF mapping reshard shares with the models is the architectures' (``arch``: one
  folder per architecture, its facts and tables, and the rule vocabulary ``arch/rules.py``);
* an environment's folder (``neon_hpc/envs/<name>/``: its episode adapter, task source,
  demonstrations, evaluation) is a plugin (part ``env_plugins``) above the agent loop it plugs
  into; the registry and interfaces (``neon_hpc/envs/*.py``, part ``envs``) are foundation, and
  the registry reaches the plugins by the module names of its table only (checked below);
* an architecture's folder (``neon_hpc/arch/<name>/``) is the architecture's, all of it: its
  ``megatron.py`` (megatron config and layer spec) imports megatron inside its functions only and
  nothing of neon_hpc above the foundation; the models reach it by the name the architecture gives
  (``Architecture.megatron_module``);
* library code imports nothing from ``tests/`` or ``tools/``.

The experiment config (``neon_hpc/config/``, one module per section) is a leaf: it imports
the helpers, the architectures' model sections and the environment registry only; an
environment's settings section reaches it through the environment's entry point.

Violations that exist today are listed in ``KNOWN`` with the issue item and the engineer who
owns the fix; any other one fails the test, and so does a listed one that is gone (remove its
line).  The table is the one place this rule is written; README.md points here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from repo_paths import REPO

LIB = REPO / "neon_hpc"

# Top to bottom.  cli -> launch -> envs/<name> -> {rollout, train} -> {store, replay, balance} -> {protocol, config}
# is the design's spine (README "Dependency direction"); the other parts are placed around it.
LAYERS: list[tuple[str, set[str]]] = [
    ("entry points", {"cli", "config_cli"}),            # neon-hpc subcommands; config check
    ("operator tools", {"ops", "plan"}),                # status, tail, plots; capacity planning (simulates the roles)
    ("launch", {"launch"}),                             # Slurm / local launcher, role entry
    ("environments", {"env_plugins"}),                  # neon_hpc/envs/<name>/: one folder per environment
    ("roles", {"rollout", "train"}),                    # the two roles; neither imports the other
    ("services", {"store", "replay", "balance", "reshard"}),   # what the roles use; reshard also stands alone
    ("models", {"models"}),                             # megatron and HF builders
    # torch_dist: metadata, integrity, config.json; trainer + reshard
    ("checkpoint format", {"checkpoint"}),
    ("foundation", {"protocol", "config", "arch", "envs", "util", "neon_hpc"}),
]
FOUNDATION = "foundation"
# part -> parts it must not import even where the layers would allow it
FORBIDDEN: dict[str, set[str]] = {
    "reshard": {"train", "models", "rollout"},
}
# parts that import nothing else of neon_hpc but the parts named: the helpers nothing; the config
# (neon_hpc/config/, a leaf) the helpers, the architectures' model sections and the environment registry
SELF_CONTAINED: dict[str, set[str]] = {"util": set(), "config": {"util", "arch", "envs"}}

# (importing file, imported module) -> "issue item, owner: what" for violations that exist now
# (none left: the architectures' and the trainer's pure config rules are their sections'
# (arch/<name>/config.py, train/config.py layout rules); `neon-hpc run` hands the plot in).
KNOWN: dict[tuple[str, str], str] = {}


def _layer_of() -> dict[str, int]:
    out: dict[str, int] = {}
    for i, (_name, parts) in enumerate(LAYERS):
        for p in parts:
            assert p not in out, f"{p} is in two layers"
            out[p] = i
    return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def part_of(module: str) -> str:
    """``neon_hpc.rollout.engines.client`` -> ``rollout``; a section ``neon_hpc.config.train`` -> ``config``;
    an environment's folder ``neon_hpc.envs.<name>[...]`` -> ``env_plugins``: by folder alone."""
    parts = module.split(".")
    if len(parts) == 1:
        return "neon_hpc"
    if len(parts) >= 3 and parts[1] == "envs" and (LIB / "envs" / parts[2]).is_dir():
        return "env_plugins"
    return parts[1]


def _is_module(name: str) -> bool:
    p = REPO.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(path: Path, mod: str | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` for every module ``path`` (the module ``mod``, by default its name in the
    repository) imports: absolute, relative, lazy, importlib."""
    mod = mod or module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            # `from neon_hpc import config` imports the module neon_hpc.config
            subs = [f"{src}.{a.name}" for a in node.names if _is_module(f"{src}.{a.name}")]
            out += [(node.lineno, s) for s in subs] or [(node.lineno, src)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def library_files() -> list[Path]:
    return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def violations() -> dict[tuple[str, str], list[str]]:
    """(importing file, imported module) -> [why, with line numbers] for every edge the rules refuse."""
    layer = _layer_of()
    outside = {p.stem for d in ("tests", "tools") for p in (REPO / d).rglob("*.py")} | {"tests", "tools"}
    found: dict[tuple[str, str], list[str]] = {}
    for path in library_files():
        rel = str(path.relative_to(REPO))
        src_part = part_of(module_name(path))
        for line, target in imports_of(path):
            top = target.split(".")[0]
            why = None
            if top in outside:
                why = f"library code imports {target} from tests/ or tools/"
            elif top == "neon_hpc":
                dst_part = part_of(target)
                if dst_part == src_part:
                    continue
                if src_part in SELF_CONTAINED and dst_part not in SELF_CONTAINED[src_part]:
                    why = f"{src_part} imports nothing of neon_hpc but {SELF_CONTAINED[src_part]}, yet imports {target}"
                elif dst_part in FORBIDDEN.get(src_part, ()):
                    why = f"{src_part} must not import {dst_part} ({target})"
                else:
                    i, j = layer[src_part], layer[dst_part]
                    if j < i:
                        why = f"{src_part} ({LAYERS[i][0]}) imports {target} from a higher layer ({LAYERS[j][0]})"
                    elif j == i and LAYERS[i][0] != FOUNDATION:
                        why = f"{src_part} imports its peer {dst_part} ({target}; both {LAYERS[i][0]})"
            if why:
                found.setdefault((rel, target), []).append(f"{rel}:{line}: {why}")
    return found


# ---------------------------------------------------------------------------------------


def test_every_part_has_a_layer():
    layer = _layer_of()
    parts = {part_of(module_name(p)) for p in library_files()}
    assert not parts - set(layer), f"parts of neon_hpc with no row in LAYERS: {sorted(parts - set(layer))}"


def test_the_scanner_sees_every_kind_of_import(tmp_path):
    """The rules are only as good as the parser: relative, lazy, aliased and importlib imports."""
    probe = tmp_path / "probe.py"        # read as if it were neon_hpc/reshard/probe.py
    probe.write_text("from ..protocol.rundir import RunDir\nfrom neon_hpc import config\n"
                   "def f():\n    import neon_hpc.train.loop as l\n    from . import tasks\n"
                   "    import importlib\n    importlib.import_module('neon_hpc.models.hf')\n")
    got = [m for _, m in imports_of(probe, "neon_hpc.reshard.probe")]
    assert got.count("neon_hpc.protocol.rundir") == 1 and "neon_hpc.config" in got
    assert {"neon_hpc.train.loop", "neon_hpc.reshard.tasks", "neon_hpc.models.hf"} <= set(got), got
    assert part_of("neon_hpc.config.train") == "config" and part_of("neon_hpc.train.loop") == "train"
    assert part_of("neon_hpc.arch.some_arch.megatron") == "arch" and part_of("neon_hpc.arch.some_arch") == "arch"
    assert part_of("neon_hpc.envs.xrd.env") == "env_plugins" and part_of("neon_hpc.envs.xrd") == "env_plugins"
    assert part_of("neon_hpc.envs.base") == "envs" and part_of("neon_hpc.config.env") == "config"


def test_imports_point_down_the_layers():
    found = violations()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    gone = sorted(k for k in KNOWN if k not in found)
    msg = "\n".join(w for ws in new.values() for w in ws)
    assert not new, (f"imports against the layer table in tests/structure/test_layers.py (fix the import, or move "
                     f"the code to the layer it belongs to):\n{msg}")
    assert not gone, f"listed in KNOWN but fixed (remove these lines from tests/structure/test_layers.py): {gone}"


def test_reshard_and_its_mapping_load_no_trainer_or_models():
    """At run time too: the converter's modules load the mapping, not neon_hpc.models/train/rollout
    (nor torch: ``--dry-run`` plans from metadata alone)."""
    code = ("import sys, neon_hpc.reshard.cli, neon_hpc.reshard.pipeline, neon_hpc.reshard.tasks, "
            "neon_hpc.reshard.hfconfig, neon_hpc.checkpoint.metadata, neon_hpc.checkpoint.integrity, "
            "neon_hpc.checkpoint.configsource, neon_hpc.arch, neon_hpc.arch.rules; "
            "import json; print(json.dumps([sorted({m.split('.')[1] for m in sys.modules "
            "if m.startswith('neon_hpc.')}), 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    parts, torch_loaded = json.loads(out.stdout)
    assert "reshard" in parts and not {"models", "train", "rollout", "launch"} & set(parts), parts
    assert not torch_loaded


def test_the_balancer_imports_no_torch():
    """``balance`` is metadata in, assignment out: no module of it imports torch or megatron, not even
    lazily (timing the trainer's step and the plain-torch stand-in are the trainer's:
    ``neon_hpc/train/costfit/``)."""
    bad = [f"{p.relative_to(REPO)}:{line}: {m}" for p in sorted((LIB / "balance").rglob("*.py"))
           for line, m in imports_of(p) if m.split(".")[0] in ("torch", "megatron")]
    assert not bad, bad


def test_one_mapping_object_for_the_models_and_reshard():
    """The rule tables the models' exporter and reshard read are the architecture's: its folder's
    hfmap.py and neon_hpc.arch.rules (the same objects)."""
    from neon_hpc import arch
    from neon_hpc.arch import rules
    from neon_hpc.reshard import slabs
    for a in arch.ARCHITECTURES.values():
        assert a.layer_rules is a.mapping.LAYER_RULES
        assert a.top_rules is rules.TOP_RULES is slabs._TOP and a.expert_rules is rules.EXPERT_RULES


def test_the_env_registry_names_only_environment_folders():
    """The registry (foundation) reaches its plugins through their entry points only: each of this
    distribution's names an environment's folder (part ``env_plugins``), whose ``PLUGIN`` carries
    the registered name."""
    from neon_hpc import envs
    for e in envs.entries():
        assert part_of(e.plugin) == "env_plugins" and e.plugin.startswith(f"neon_hpc.envs.{e.name}."), e
        assert envs.get(e.name).name == e.name


def test_no_two_parts_import_each_other():
    """Foundation parts may import each other by the table; even there no pair does it both ways."""
    edges: dict[tuple[str, str], str] = {}
    for path in library_files():
        src = part_of(module_name(path))
        for line, target in imports_of(path):
            dst = part_of(target) if target.split(".")[0] == "neon_hpc" else None
            if dst and dst != src:
                edges.setdefault((src, dst), f"{path.relative_to(REPO)}:{line} imports {target}")
    both = [f"{a} <-> {b}: {edges[(a, b)]}; {edges[(b, a)]}" for (a, b) in edges if (b, a) in edges and a < b]
    assert not both, "parts importing each other (move the shared code down a layer):\n" + "\n".join(both)
