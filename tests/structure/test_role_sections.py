"""Each role reads only the sections it is given (issue 23 item 2, ``neon_hpc/rollout/sections.py``).

The rollout worker gets :class:`WorkerSections`, the rollout node (and the engine group it
builds) :class:`NodeSections`, the trainer :class:`TrainerSections`; what they borrow from a
neighbour's section (``train``, ``model``, ``launch``, ``rollout``) is a named field of the view. An AST scan
over ``neon_hpc/rollout``, ``neon_hpc/store`` and ``neon_hpc/train`` finds every ``cfg.<section>`` read
(``cfg``, ``self.cfg``, ``sec``, ...) and fails on a section the module's role is not given. The allowlist
below is empty: an entry would name the module, the expression and why."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from neon_hpc import config
from neon_hpc.rollout.sections import NodeSections, WorkerSections
from neon_hpc.train.sections import TrainerSections
from repo_paths import REPO

LIB = REPO / "neon_hpc"
TINY = str(REPO / "configs" / "tiny_cpu.yaml")

SECTIONS = {f.name for f in dataclasses.fields(config.ExperimentConfig)
            if f.default_factory is not dataclasses.MISSING}         # model, train, rollout, ...
CONFIG_NAMES = {"cfg", "config", "sec", "sections", "experiment"}    # what a config (or a view) is called


def _given(view) -> set[str]:
    return {f.name for f in dataclasses.fields(view)} & SECTIONS


# module (relative to neon_hpc/, a prefix for packages) -> the sections it may read; the first
# match wins; a module of these parts that matches none may read no section at all
GIVEN: list[tuple[str, set[str] | None]] = [
    ("rollout/sections.py", None),                      # builds the views: reads the whole config
    ("rollout/worker.py", _given(WorkerSections)),
    ("rollout/node.py", _given(NodeSections)),
    ("rollout/engines/", _given(NodeSections)),         # the engine group gets the node's view
    ("rollout/", set()),
    ("store/", set()),                                  # the store is handed values, never a config
    ("train/sections.py", None),                        # builds the trainer's view
    ("train/__main__.py", None),                        # an entry point: loads the config, builds the view
    ("train/", _given(TrainerSections)),                # loop, layout (config/cross.py's rules), ...
]

# (module, expression) -> why it may read a section its role is not given
ALLOWED: dict[tuple[str, str], str] = {}


def _rule(rel: str) -> set[str] | None:
    for prefix, given in GIVEN:
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            return given
    raise AssertionError(f"no rule for {rel}")


def _is_config(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in CONFIG_NAMES) or \
        (isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES)


def section_reads(source: str) -> list[tuple[int, str, str]]:
    """``(line, section, expression)`` of every ``<config>.<section>`` in ``source``; the
    expression is the longest attribute chain above it (``cfg.train.trajectories_per_step``)."""
    tree = ast.parse(source)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SECTIONS and _is_config(node.value):
            top = node
            while isinstance(parents.get(id(top)), ast.Attribute):
                top = parents[id(top)]
            out.append((node.lineno, node.attr, ast.unparse(top)))
    return out


def offences() -> list[str]:
    out = []
    for part in ("rollout", "store", "train"):
        for path in sorted((LIB / part).rglob("*.py")):
            rel = str(path.relative_to(LIB))
            given = _rule(rel)
            if given is None:
                continue
            for line, section, expr in section_reads(path.read_text()):
                if section not in given and (rel, expr) not in ALLOWED:
                    out.append(f"neon_hpc/{rel}:{line}: {expr} (its role is given {sorted(given) or 'no section'})")
    return out


def test_no_role_reads_a_section_it_is_not_given():
    found = offences()
    assert not found, ("a role reads a config section it is not given; add the value to its view in "
                       "neon_hpc/rollout/sections.py as a borrowed field (or justify it in ALLOWED):\n"
                       + "\n".join(found))


def test_every_allowlist_line_is_still_needed():
    used = set()
    for rel, expr in ALLOWED:
        if any(e == expr for _, _, e in section_reads((LIB / rel).read_text())):
            used.add((rel, expr))
    assert used == set(ALLOWED), f"stale ALLOWED entries (delete them): {sorted(set(ALLOWED) - used)}"


def test_the_scan_sees_what_it_looks_for():
    probe = ("def f(cfg, self):\n    a = cfg.train.trajectories_per_step\n    b = self.cfg.model.tokenizer\n"
             "    c = sec.rollout.group_size\n    d = self.model.forward\n    e = args.model\n")
    got = [(line, s, e) for line, s, e in section_reads(probe)]
    assert got == [(2, "train", "cfg.train.trajectories_per_step"), (3, "model", "self.cfg.model.tokenizer"),
                   (4, "rollout", "sec.rollout.group_size")], got    # not a model object, not argparse's
    assert "train" not in _rule("rollout/worker.py") and "model" not in _rule("rollout/worker.py")
    assert _rule("rollout/agent/group.py") == set()
    assert "rollout" not in _rule("train/loop.py") and "engine" not in _rule("train/loop.py")


def test_the_views_hold_the_config_and_its_borrowed_values():
    cfg = config.load(TINY, ["train.trajectories_per_step=12", "model.tokenizer=", "model.init_checkpoint=/ck"])
    w = WorkerSections.of(cfg)
    assert w.rollout is cfg.rollout and w.protocol is cfg.protocol and w.store is cfg.store and w.env is cfg.env
    assert type(w.env).__name__ == "XRDConfig" and w.env.preset == "tiny"     # env.kind xrd: its variant
    assert (w.train_trajectories_per_step, w.model_tokenizer) == (12, "/ck")   # "": init_checkpoint's tokenizer
    assert (w.model_num_layers, w.model_moe_router_topk) == (cfg.model.num_layers, cfg.model.moe_router_topk)
    assert WorkerSections.of(config.load(TINY)).model_tokenizer == "xrd-tiny"
    n = NodeSections.of(cfg)
    assert (n.rollout, n.engine, n.protocol, n.launch, n.run_dir) == \
        (cfg.rollout, cfg.engine, cfg.protocol, cfg.launch, cfg.run_dir)
    t = TrainerSections.of(config.load(TINY, ["offpolicy.max_staleness=3", "offpolicy.stale_policy=drop"]))
    assert (t.offpolicy.max_staleness, t.offpolicy.stale_policy) == (3, "drop")
    assert not hasattr(t, "rollout") and not hasattr(w, "train") and not hasattr(w, "model")
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.train_trajectories_per_step = 1


def test_the_engine_group_and_layout_work_from_the_nodes_view(tmp_path):
    """The node hands its view, not the config, to rollout/engines: the layout and the SGLang
    command lines come out the same."""
    from neon_hpc.config.rollout import layout
    from neon_hpc.rollout.engines.sglang_launch import render_commands
    cfg = config.load(TINY, ["engine.kind=sglang", "engine.num_engines=2", "engine.tp_size=2"])
    view = NodeSections.of(cfg)
    assert layout(view) == layout(cfg)
    assert render_commands(view) == render_commands(cfg)
