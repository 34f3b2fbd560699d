"""Environments: one folder each (``neon_hpc/envs/<name>/``, or another distribution's package),
found by entry point.

An environment registers itself with one entry point of the group ``neon_hpc.envs`` whose value
is its :class:`~neon_hpc.envs.base.EnvEntry` (name, the module of its ``PLUGIN``, one line for
``neon-hpc env list``, its held-out splits, its settings section and command)::

    [project.entry-points."neon_hpc.envs"]
    xrd = "neon_hpc.envs.xrd.entry:ENTRY"

so a third party adds an environment by installing a package, without editing this library.  The
config key ``env.kind`` chooses one (``neon_hpc/config/env.py``); the rollout worker, the warm
start and the eval set ask :func:`get` and never name an environment.  The entries are read on
first use; :func:`get` imports the plugin when the environment is used (an environment's folder
sits above the agent loop it plugs into: tests/structure/test_layers.py), so listing or validating names
imports no environment.  ``neon-hpc env list`` prints them.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from neon_hpc.envs.base import ConfiguredEnv, EnvEntry, Environment, EnvPlugin, TaskSource

GROUP = "neon_hpc.envs"

REGISTRY: dict[str, EnvEntry] = {}       # name -> entry: the installed ones, then run-time ones (tests)
_INSTALLED: set[str] = set()
_LOADED: dict[str, EnvPlugin] = {}


def _discover() -> dict[str, EnvEntry]:
    """Read the installed entry points once (sorted by name, so every process sees one order)."""
    if _INSTALLED:
        return REGISTRY
    found = sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name)
    if not found:
        raise RuntimeError(f"no environment is installed (entry point group {GROUP!r} is empty): "
                           f"install neon-hpc (`pip install -e .` in the checkout, or `bash env/setup.sh`)")
    for ep in found:
        entry = ep.load()
        if not isinstance(entry, EnvEntry) or entry.name != ep.name:
            raise RuntimeError(f"entry point {ep.name} = {ep.value!r} (group {GROUP}) must name an EnvEntry "
                               f"called {ep.name!r}; got {entry!r:.200}")
        REGISTRY.setdefault(entry.name, entry)
        _INSTALLED.add(entry.name)
    return REGISTRY


def entries() -> tuple[EnvEntry, ...]:
    """Every registered environment's entry, installed ones first (sorted by name)."""
    return tuple(_discover().values())


def kinds() -> tuple[str, ...]:
    """The registered names, the installed ones first, then any registered at run time (tests)."""
    return tuple(_discover())


def known() -> str:
    return ", ".join(kinds())


def get(kind: str) -> EnvPlugin:
    """The plugin of ``kind`` (config ``env.kind``); ValueError naming the registered ones otherwise."""
    if kind not in _discover():
        raise ValueError(f"unknown environment {kind!r}; registered: {known()} (neon-hpc env list)")
    if kind not in _LOADED:
        plugin = importlib.import_module(REGISTRY[kind].plugin).PLUGIN
        if plugin.name != kind:
            raise ValueError(f"{REGISTRY[kind].plugin}.PLUGIN is named {plugin.name!r}, registered as {kind!r}")
        _LOADED[kind] = plugin
    return _LOADED[kind]


def eval_splits(kind: str) -> tuple[str, ...]:
    """The held-out splits of a registered environment (``eval.split``); () for an unknown kind."""
    return REGISTRY[kind].eval_splits if kind in _discover() else ()


def register(plugin: EnvPlugin, eval_splits: tuple[str, ...]) -> None:
    """Register ``plugin`` at run time (a test's throwaway environment) with its held-out splits;
    a taken name is refused."""
    if plugin.name in _discover():
        raise ValueError(f"environment {plugin.name!r} is already registered")
    REGISTRY[plugin.name] = EnvEntry(plugin.name, "", plugin.about, tuple(eval_splits))
    _LOADED[plugin.name] = plugin


def unregister(name: str) -> None:
    """Remove a run-time registration (the installed entries stay)."""
    if name in _INSTALLED:
        raise ValueError(f"environment {name!r} is installed (an entry point); it cannot be removed")
    REGISTRY.pop(name, None)
    _LOADED.pop(name, None)


def configured(cfg) -> ConfiguredEnv:
    """The environment ``cfg.env.kind`` chooses, bound to the ``env:`` section of the experiment config ``cfg``."""
    return get(cfg.env.kind).bind(cfg.env)


__all__ = ["GROUP", "ConfiguredEnv", "EnvEntry", "EnvPlugin", "Environment", "REGISTRY", "TaskSource",
           "configured", "entries", "eval_splits", "get", "kinds", "known", "register", "unregister"]
