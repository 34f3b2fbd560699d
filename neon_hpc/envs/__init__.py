"""Environments: one folder each (``neon_hpc/envs/<name>/``), registered here by name.

A folder holds everything specific to its environment: its episode adapter (prompts, tools,
answer reading, grading), its task source, optionally demonstrations and evaluation tools, and
``PLUGIN``: the :class:`~neon_hpc.envs.base.EnvPlugin` that ties them together.  The config key
``env.kind`` chooses one (``neon_hpc/config/env.py``); the rollout worker, the warm start and
the eval set ask :func:`get` and never name an environment.  ``neon-hpc env list`` prints them.

The table below names each plugin's module; :func:`get` imports it when the environment is
used (an environment's folder sits above the agent loop it plugs into: tests/test_layers.py),
so listing or validating names imports no environment.

Adding an environment: a folder with ``PLUGIN`` in its ``__init__.py``, and its line in
``_REGISTERED`` (neon_hpc/envs/README.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from neon_hpc.envs.base import ConfiguredEnv, EnvPlugin, Environment, TaskSource


@dataclass(frozen=True)
class Registered:
    name: str
    module: str          # defines PLUGIN
    about: str           # one line for `neon-hpc env list`
    # the held-out splits its task source's held_out() takes: what `eval.split` may be (the
    # config checks it here, without importing the environment); the first is the usual one
    eval_splits: tuple[str, ...]


_REGISTERED: tuple[Registered, ...] = (
    Registered("xrd", "neon_hpc.envs.xrd", "powder X-ray diffraction: phases and weight fractions of a pattern, with tools",
               ("test_id", "test_ood", "test_temporal")),
    Registered("digits", "neon_hpc.envs.digits", "add two digits, no tools: a task the tiny model learns on CPU",
               ("test_id",)),
)

REGISTRY: dict[str, Registered] = {r.name: r for r in _REGISTERED}
_LOADED: dict[str, EnvPlugin] = {}
DEFAULT = _REGISTERED[0].name


def kinds() -> tuple[str, ...]:
    """The registered names, the table's first, then any registered at run time (tests)."""
    return tuple(REGISTRY)


def known() -> str:
    return ", ".join(kinds())


def get(kind: str) -> EnvPlugin:
    """The plugin of ``kind`` (config ``env.kind``); ValueError naming the registered ones otherwise."""
    if kind not in REGISTRY:
        raise ValueError(f"unknown environment {kind!r}; registered: {known()} (neon-hpc env list)")
    if kind not in _LOADED:
        plugin = importlib.import_module(REGISTRY[kind].module).PLUGIN
        if plugin.name != kind:
            raise ValueError(f"{REGISTRY[kind].module}.PLUGIN is named {plugin.name!r}, registered as {kind!r}")
        _LOADED[kind] = plugin
    return _LOADED[kind]


def eval_splits(kind: str) -> tuple[str, ...]:
    """The held-out splits of a registered environment (``eval.split``); () for an unknown kind."""
    return REGISTRY[kind].eval_splits if kind in REGISTRY else ()


def register(plugin: EnvPlugin, eval_splits: tuple[str, ...]) -> None:
    """Register ``plugin`` at run time (a test's throwaway environment) with its held-out splits;
    a taken name is refused."""
    if plugin.name in REGISTRY:
        raise ValueError(f"environment {plugin.name!r} is already registered")
    REGISTRY[plugin.name] = Registered(plugin.name, "", plugin.about, tuple(eval_splits))
    _LOADED[plugin.name] = plugin


def unregister(name: str) -> None:
    """Remove a run-time registration (the table's entries stay)."""
    if any(r.name == name for r in _REGISTERED):
        raise ValueError(f"environment {name!r} is in the registry table; it cannot be removed")
    REGISTRY.pop(name, None)
    _LOADED.pop(name, None)


def settings(plugin: EnvPlugin, cfg) -> object | None:
    """The plugin's config section of the experiment config ``cfg`` (None when it has none)."""
    return getattr(cfg, plugin.section) if plugin.section else None


def configured(cfg) -> ConfiguredEnv:
    """The environment ``cfg.env.kind`` chooses, bound to its section of the experiment config ``cfg``."""
    plugin = get(cfg.env.kind)
    return plugin.bind(settings(plugin, cfg))


__all__ = ["DEFAULT", "ConfiguredEnv", "EnvPlugin", "Environment", "REGISTRY", "Registered", "TaskSource",
           "configured", "eval_splits", "get", "kinds", "known", "register", "settings", "unregister"]
