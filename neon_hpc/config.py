"""The experiment config: one pydantic v2 model, composed of one small section per component.

Each component owns its section (``neon_hpc/<component>/config.py``, a dataclass marked
:func:`neon_hpc.constraints.section`); this module composes them, loads YAML, applies ``--set
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

from neon_hpc import constraints
from neon_hpc.constraints import section
from neon_hpc.util.bounded import REPR_CAP, clip_text, short_repr
from neon_hpc.balance.config import BalanceConfig
from neon_hpc.envs.config import EnvConfig, eval_split_errors
from neon_hpc.launch.config import LaunchConfig, WarmStartConfig
from neon_hpc.util.logsinks import LoggingConfig
from neon_hpc.models.config import DefaultModelConfig, ModelSection, arch_experiment_errors
from neon_hpc.plan.config import PlanConfig
from neon_hpc.protocol.config import ProtocolConfig
from neon_hpc.rollout.config import EngineConfig, EvalConfig, RolloutConfig, layout
from neon_hpc.store.config import StoreConfig
from neon_hpc.train.config import TrainConfig, correction_errors, launch_world_errors, layout_errors
from neon_hpc.xrd.config import XRDConfig


def _cross_checks(cfg: "ExperimentConfig") -> list[tuple[str, str]]:
    return cross_errors(cfg)


@section
@dataclass
class ExperimentConfig:
    name: str = "tiny_cpu"
    run_dir: str = "runs/tiny_cpu"
    mode: Literal["async", "sync"] = "async"
    model: ModelSection = field(default_factory=DefaultModelConfig)   # one section per architecture (model.arch)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    xrd: XRDConfig = field(default_factory=XRDConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    CROSS = (_cross_checks,)     # the rules across sections (cross_errors below), after every section passes


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where and how to fix it."""


def cross_errors(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """``[(key path, message)]``: what the rules across sections refuse (empty = fine)."""
    errs = []
    if cfg.rollout.max_total_tokens > cfg.model.max_position_embeddings:
        # the engines refuse prompt + generation beyond the context (embedded: engines.embedded.admit)
        errs.append(("rollout.max_total_tokens",
                     f"{cfg.rollout.max_total_tokens} is over model.max_position_embeddings "
                     f"({cfg.model.max_position_embeddings}): episodes would grow past the context the "
                     f"engines serve; lower it to at most {cfg.model.max_position_embeddings}"))
    errs += correction_errors(cfg)
    if cfg.train.expert_parallel > 1 and cfg.model.num_experts % cfg.train.expert_parallel:
        errs.append(("train.expert_parallel",
                     f"must divide model.num_experts ({cfg.model.num_experts})"))
    if cfg.train.tensor_parallel > 1 and cfg.model.num_query_groups % cfg.train.tensor_parallel:
        errs.append(("train.tensor_parallel",
                     f"must divide model.num_query_groups ({cfg.model.num_query_groups})"))
    errs += arch_experiment_errors(cfg)                  # what the architecture refuses elsewhere
    errs += eval_split_errors(cfg)                       # a held-out split of the chosen environment
    cp, thr = cfg.train.context_parallel, cfg.balance.split_threshold_tokens
    if thr and (cp == 1 or thr < 2 * cp):
        errs.append(("balance.split_threshold_tokens",
                     f"{thr}: zigzags pieces into 2*train.context_parallel chunks, so it needs "
                     f"context_parallel > 1 (now {cp}) and a threshold >= 2*context_parallel; set it "
                     f"to 0 (auto) or raise it"))
    errs += layout_errors(cfg) + launch_world_errors(cfg)   # the trainer's own rules (train section)
    if cfg.engine.kind == "sglang":
        lay = layout(cfg)
        if cfg.launch.rollout.nodes < lay.nodes_needed:
            errs.append(("launch.rollout.nodes",
                         f"{cfg.engine.num_engines} engine(s) of {lay.gpus_per_engine} GPUs "
                         f"(engine.tp_size x dp_size) need {lay.nodes_needed} node(s) of "
                         f"{lay.gpus_per_node} GPUs, the rollout group has {cfg.launch.rollout.nodes}: "
                         f"raise launch.rollout.nodes or lower engine.num_engines"))
        if cfg.engine.pd_disaggregation and is_loopback(cfg.engine.host) and lay.nodes_needed > 1:
            errs.append(("engine.host",
                         f"{cfg.engine.host} is reachable from its own node only, but the PD router and "
                         f"the engines of this layout are on {lay.nodes_needed} nodes: set engine.host: "
                         f"0.0.0.0 (or the nodes' fabric address)"))
    return errs


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


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
