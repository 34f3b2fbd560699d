"""The experiment config: one typed schema, composed of one small dataclass per component.

Each component owns its section (``neon_hpc/<component>/config.py``); this module composes
them, loads YAML, applies ``--set key.path=value`` overrides and validates.  Every error
names the file, the key path, what was expected, and (for a misspelt key) the closest
valid one::

    configs/x.yaml: train.lrr: unknown key; did you mean 'train.lr'?

Value ranges are declared beside the fields (each section's ``CHECKS`` and ``RULES``) and
checked by one checker, :mod:`neon_hpc.constraints`; a field that declares nothing still
gets its annotation's default (floats finite and ``>= 0``, ints ``>= 0`` and below
``2**63``).  Every violation is reported, each with the file, the key, the bad value and
what is allowed::

    configs/x.yaml (with --set train.lr=nan): train.lr: got nan; allowed: a finite number in (0, 1]

Cross-section rules live in :func:`_cross_checks`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from neon_hpc import constraints
from neon_hpc.bounded import REPR_CAP, clip_text, short_repr
from neon_hpc.balance.config import BalanceConfig
from neon_hpc.envs.config import EnvConfig
from neon_hpc.launch.config import LaunchConfig, WarmStartConfig
from neon_hpc.logsinks import LoggingConfig
from neon_hpc.models.config import ModelConfig, arch_experiment_errors
from neon_hpc.plan.config import PlanConfig
from neon_hpc.protocol.config import ProtocolConfig
from neon_hpc.rollout.config import EngineConfig, EvalConfig, RolloutConfig
from neon_hpc.store.config import StoreConfig
from neon_hpc.train.config import TrainConfig, launch_world_errors, layout_errors
from neon_hpc.xrd.config import XRDConfig


@dataclass
class ExperimentConfig:
    name: str = "tiny_cpu"
    run_dir: str = "runs/tiny_cpu"
    mode: Literal["async", "sync"] = "async"
    model: ModelConfig = field(default_factory=ModelConfig)
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


class ConfigError(ValueError):
    """A config file or override is wrong; the message says where and how to fix it."""


def _cross_checks(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    errs = []
    if cfg.rollout.max_total_tokens > cfg.model.max_position_embeddings:
        # the engines refuse prompt + generation beyond the context (embedded: engines.embedded.admit)
        errs.append(("rollout.max_total_tokens",
                     f"{cfg.rollout.max_total_tokens} is over model.max_position_embeddings "
                     f"({cfg.model.max_position_embeddings}): episodes would grow past the context the "
                     f"engines serve; lower it to at most {cfg.model.max_position_embeddings}"))
    if cfg.mode == "async" and cfg.train.off_policy_correction == "none":
        errs.append(("train.off_policy_correction",
                     "an async run trains on tokens from older weight versions; with no off-policy "
                     "correction the update is silently biased. Set it to 'tis' (or mode: sync)"))
    if cfg.model.moe_router_topk > cfg.model.num_experts:
        pass  # reported by the model section
    if cfg.train.expert_parallel > 1 and cfg.model.num_experts % cfg.train.expert_parallel:
        errs.append(("train.expert_parallel",
                     f"must divide model.num_experts ({cfg.model.num_experts})"))
    if cfg.train.tensor_parallel > 1 and cfg.model.num_query_groups % cfg.train.tensor_parallel:
        errs.append(("train.tensor_parallel",
                     f"must divide model.num_query_groups ({cfg.model.num_query_groups})"))
    errs += arch_experiment_errors(cfg)                  # what the architecture refuses elsewhere
    cp, thr = cfg.train.context_parallel, cfg.balance.split_threshold_tokens
    if thr and (cp == 1 or thr < 2 * cp):
        errs.append(("balance.split_threshold_tokens",
                     f"{thr}: zigzags pieces into 2*train.context_parallel chunks, so it needs "
                     f"context_parallel > 1 (now {cp}) and a threshold >= 2*context_parallel; set it "
                     f"to 0 (auto) or raise it"))
    errs += layout_errors(cfg) + launch_world_errors(cfg)   # the trainer's own rules (train section)
    if cfg.engine.kind == "sglang":
        from neon_hpc.rollout.config import layout
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


# --------------------------------------------------------------------------------------
# generic dataclass <- dict conversion with precise errors

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    if origin is dict:
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str, where: str) -> Any:
    def bad(extra: str = "") -> ConfigError:
        return ConfigError(f"{where}: {key}: expected {_type_name(tp)}, got {short_repr(value)}"
                           f" ({type(value).__name__}){extra}")

    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return _from_dict(tp, value, key, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
            raise bad(f"; did you mean {close[0]!r}?" if close else "")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, key, where)
            except ConfigError:
                pass
        raise bad()
    if origin is list:
        if not isinstance(value, list):
            raise bad()
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_convert(item_tp, v, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("; write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-4 (no dot) as a string; accept what float() accepts
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad("; quote it in YAML")
        return value
    raise bad()


def _from_dict(cls: type, data: dict, prefix: str, where: str) -> Any:
    hints = constraints.type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else \
                f"; valid keys here: {', '.join(names)}"
            raise ConfigError(f"{where}: {clip_text(path, REPR_CAP)}: unknown key{hint}")
        kwargs[k] = _convert(hints[k], v, path, where)
    return cls(**kwargs)


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


def from_dict(data: dict, where: str = "<config>") -> ExperimentConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    cfg = _from_dict(ExperimentConfig, data, "", where)
    check(cfg, where)
    return cfg


def check(cfg: ExperimentConfig, where: str = "<config>") -> None:
    """Raise one :class:`ConfigError` listing every out-of-range value, then cross-section rules."""
    bad = constraints.check(cfg)
    if bad:
        raise ConfigError("\n".join(f"{where}: {v}" for v in bad))
    for key, msg in _cross_checks(cfg):
        raise ConfigError(f"{where}: {key}: {msg}")


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
