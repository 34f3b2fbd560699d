"""The experiment config: one pydantic v2 model, composed of one small section per component.

A leaf package (pydantic and yaml; no h5py, numpy, torch or megatron: ``tests/structure/test_imports.py``).
Each section is one module here (``neon_hpc/config/<section>.py``, a dataclass marked
:func:`neon_hpc.util.constraints.section`); an architecture's ``model:`` variant is its
folder's (``neon_hpc/arch/<name>/config.py``), the rules across sections are
``neon_hpc/config/cross.py``; an environment's ``env:`` variant is supplied by its entry point
(``neon_hpc/config/env.py``).  This module composes them, loads YAML, applies ``--set
key.path=value`` overrides and validates with pydantic.  Types, ranges (``CHECKS``), enums
(``Literal``) and cross-field rules (``RULES``) are declared beside the fields; the rules across
sections are :attr:`ExperimentConfig.CROSS`, each written once.  Every error names the file, the
key path, what was expected, and (for a misspelt key) the closest valid one::

    configs/x.yaml: train.lrr: unknown key; did you mean 'train.lr'?

Every violation is reported at once, each with the file, the key, the bad value and what is
allowed::

    configs/x.yaml (with --set train.lr=nan): train.lr: got nan; allowed: a finite number in (0, 1]

``neon-hpc config schema`` prints the JSON schema (:func:`json_schema`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from neon_hpc.config.balance import BalanceConfig
from neon_hpc.config.cross import cross_errors
from neon_hpc.config.env import SECTIONS as ENV_SECTIONS, DefaultEnvConfig, EnvSection
from neon_hpc.config.launch import LaunchConfig, WarmStartConfig
from neon_hpc.config.logging import LoggingConfig
from neon_hpc.config.model import DefaultModelConfig, ModelSection
from neon_hpc.config.offpolicy import OffpolicyConfig
from neon_hpc.config.plan import PlanConfig
from neon_hpc.config.protocol import ProtocolConfig
from neon_hpc.config.rollout import EngineConfig, EvalConfig, RolloutConfig
from neon_hpc.config.store import StoreConfig
from neon_hpc.config.train import TrainConfig
from neon_hpc.util import constraints
from neon_hpc.util.bounded import REPR_CAP, clip_text, short_repr
from neon_hpc.util.constraints import section


@section
@dataclass
class ExperimentConfig:
    """The experiment config: one section per component; ``model:`` and ``env:`` are unions
    chosen by ``model.arch`` / ``env.kind`` (an environment's settings are its ``env:`` variant,
    supplied by its entry point)."""

    name: str = "tiny_cpu"
    run_dir: str = "runs/tiny_cpu"
    # async: rollouts overlap training; sync: they do not (train.mode: rl|sft)
    schedule: Literal["async", "sync"] = "async"
    model: ModelSection = field(default_factory=DefaultModelConfig)   # one section per architecture (model.arch)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    offpolicy: OffpolicyConfig = field(default_factory=OffpolicyConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    env: EnvSection = field(default_factory=DefaultEnvConfig)         # one section per environment (env.kind)
    plan: PlanConfig = field(default_factory=PlanConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # the rules across sections (config/cross.py), after every section passes
    CROSS = (cross_errors,)
    # `mode` was two things (this and train.mode): the schedule is `schedule` now; an
    # environment's settings were once their own top-level section (xrd:)
    MOVED = {"mode": "schedule",
             **{k: f"env: with kind: {k} (move the {k}: keys under env:)"
                for k, c in ENV_SECTIONS.items() if len(constraints.hints(c)) > 1}}


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where and how to fix it."""


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {short_repr(item)}: expected key.path=value, e.g. --set train.lr=1e-4")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {short_repr(item)}: value is not valid YAML ({clip_text(str(e), REPR_CAP)})") from e
    return key.strip().split("."), value


def _apply_override(data: dict, keys: list[str], value: Any) -> None:
    d = data
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {k} is not a section")
        d = nxt
    d[keys[-1]] = value


def _error(exc: ValidationError, where: str) -> ConfigError:
    return ConfigError("\n".join(f"{where}: {line}" for line in constraints.explain(ExperimentConfig, exc)))


def from_dict(data: dict, where: str = "<config>") -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        return constraints.adapter(ExperimentConfig).validate_python(data)
    except ValidationError as e:
        raise _error(e, where) from None


def check(cfg: ExperimentConfig, where: str = "<config>") -> None:
    """Raise one :class:`ConfigError` listing every error of a config built in code."""
    try:
        constraints.validate(cfg)
    except ValidationError as e:
        raise _error(e, where) from None


def json_schema() -> dict:
    """The experiment config's JSON schema (``neon-hpc config schema``)."""
    return constraints.json_schema(ExperimentConfig)


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Load a YAML experiment (``None`` = all defaults) and apply ``key.path=value`` overrides."""
    data: dict = {}
    where = "<defaults>"
    if path is not None:
        where = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such config file; the examples live in configs/") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); the file is damaged") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:   # one line: what and where (the default str spans several)
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}{at}") from e
    for item in overrides:
        keys, value = _parse_override(item)
        _apply_override(data, keys, value)
    if overrides:
        where += " (with --set " + " ".join(clip_text(o, REPR_CAP) for o in overrides) + ")"
    return from_dict(data, where)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
