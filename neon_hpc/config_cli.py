"""``neon-hpc config check CONFIG [--set k=v ...]``: validate and print the resolved config;
``neon-hpc config schema``: print the experiment config's JSON schema (editors complete configs
from it: e.g. a ``# yaml-language-server: $schema=neon-hpc.schema.json`` line atop a config).

Beyond the schema (types, declared ranges, cross-field rules: the pydantic model of
:mod:`neon_hpc.config`, built from :mod:`neon_hpc.util.constraints`),
it runs what every role checks when it starts, so a config that a role would refuse later
(minutes into a Slurm job) is refused here:

- trainer: ``train.loop.check_config`` (mode vs correction, parallel layout, what this
  trainer runs), ``model.init_checkpoint`` (an HF folder, or a torch_dist checkpoint whose
  pickles pass ``train.checkpoint.refuse_untrusted``), ``balance`` cost model (the
  ``cost_file`` it would read);
- rollout workers: the environment's task set (``env.kind``'s plugin: for XRD, preset and split
  give tasks), the tokenizer;
- rollout node: ``engine.python`` for ``engine.kind: sglang``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from neon_hpc import config, envs
from neon_hpc.balance.configured import cost_model_for_config
from neon_hpc.checkpoint.metadata import CheckpointError
from neon_hpc.config import ConfigError, ExperimentConfig
from neon_hpc.util.bounded import MESSAGE_CAP, clip_text

Problem = tuple[str, str]   # (role: key, message)


def _trainer(cfg: ExperimentConfig) -> list[Problem]:
    # torch is imported where used (the trainer's checks): `neon-hpc config check` stays light
    from neon_hpc.train.loop import TrainerError, check_config  # deferred: heavy (neon_hpc.train.loop: torch, tqdm)
    try:
        check_config(cfg)
    except TrainerError as e:
        return [("trainer", str(e))]
    return []


def _init_checkpoint(cfg: ExperimentConfig) -> list[Problem]:
    if not cfg.model.init_checkpoint:
        return []
    # deferred: heavy (neon_hpc.train.checkpoint: torch, tqdm)
    from neon_hpc.train.checkpoint import check_init_checkpoint  # the trainer's own start-up check
    try:
        check_init_checkpoint(cfg.model.init_checkpoint)
    except CheckpointError as e:
        return [("trainer", str(e))]
    return []


def _cost_model(cfg: ExperimentConfig) -> list[Problem]:
    try:
        cost_model_for_config(cfg)
    except ValueError as e:
        return [("trainer", f"balance.cost_file: {e}")]
    return []


def _tasks(cfg: ExperimentConfig) -> list[Problem]:
    env = envs.configured(cfg)
    key = "env"
    try:
        source = env.tasks()
        tasks = source.train(2)
    except (ValueError, RuntimeError) as e:
        return [("rollout worker", f"{key}: {e}")]
    if not tasks:
        return [("rollout worker", f"{key}: no tasks for {cfg.env.kind} {source.describe()}")]
    return []


def _tokenizer(cfg: ExperimentConfig) -> list[Problem]:
    tok = cfg.model.tokenizer
    if tok == "xrd-tiny":
        return []   # the built-in tokenizer
    if not tok:
        if not cfg.model.init_checkpoint:
            return [("rollout worker", "model.tokenizer is \"\" (the tokenizer saved in model.init_checkpoint), "
                                       "but model.init_checkpoint is empty: set one of them to the model's HF folder")]
        return []
    if not Path(tok).exists():
        return [("rollout worker", f"model.tokenizer: {tok} does not exist; use 'xrd-tiny', a directory or file "
                                   f"with neon_tokenizer.json, or the model's HF tokenizer folder")]
    return []


def _sglang_python(cfg: ExperimentConfig) -> list[Problem]:
    py = cfg.engine.python
    if cfg.engine.kind != "sglang" or not py:
        return []
    if os.sep in py and not os.access(py, os.X_OK) or os.sep not in py and shutil.which(py) is None:
        return [("rollout node", f"engine.python: {py} is not an executable interpreter")]
    return []


ROLE_CHECKS: tuple[Callable[[ExperimentConfig], list[Problem]], ...] = (
    _trainer, _init_checkpoint, _cost_model, _tasks, _tokenizer, _sglang_python)


def role_problems(cfg: ExperimentConfig) -> list[Problem]:
    """What the roles would refuse at start-up, each as (role, message)."""
    out: list[Problem] = []
    for check in ROLE_CHECKS:
        out += check(cfg)
    return out


def check(path: str | None, overrides: list[str]) -> ExperimentConfig:
    """The config as ``neon-hpc config check`` accepts it; raises ConfigError otherwise."""
    cfg = config.load(path, overrides)
    problems = role_problems(cfg)
    if problems:
        where = path or "<defaults>"
        raise ConfigError("\n".join(f"{where}: {role} would refuse it: {clip_text(msg, MESSAGE_CAP)}"
                                    for role, msg in problems))
    return cfg


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc config")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check",
                       help="validate a config (schema and every role's start-up checks) and print it resolved")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sub.add_parser("schema", help="print the experiment config's JSON schema (types, ranges, enums, defaults)")
    a = p.parse_args(argv)
    if a.cmd == "schema":
        print(json.dumps(config.json_schema(), indent=2, sort_keys=True))
        return 0
    cfg = check(a.config, a.set)
    print(config.dump(cfg), end="")
    return 0
