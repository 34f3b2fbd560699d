"""Config errors name the file, the key path, what was expected, and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from neon_hpc import config
from neon_hpc.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "kimi_k2_1300xh200.yaml"])
def test_shipped_configs_validate(name):
    cfg = config.load(REPO / "configs" / name)
    assert cfg.train.off_policy_correction == "tis"
    # round trip: the resolved config dumps to YAML that loads to the same object
    assert config.from_dict(config.to_dict(cfg)) == cfg


def test_override_sets_typed_value():
    cfg = config.load(REPO / "configs" / "tiny_cpu.yaml", ["train.lr=1e-4", "rollout.group_size=8"])
    assert cfg.train.lr == pytest.approx(1e-4) and cfg.rollout.group_size == 8


BAD = [
    # (yaml text, substrings the message must contain)
    ("train:\n  lrr: 0.1\n", ["bad.yaml", "train.lrr", "unknown key", "did you mean 'train.lr'"]),
    ("train:\n  steps: many\n", ["bad.yaml", "train.steps", "expected int", "'many'"]),
    ("rollout:\n  replay_mode: delt\n", ["rollout.replay_mode", "one of 'delta', 'full', 'off'", "did you mean 'delta'"]),
    ("train:\n  off_policy_correction: none\n", ["train.off_policy_correction", "async", "'tis'"]),
    ("model:\n  num_experts: 4\n  moe_router_topk: 6\n", ["model.moe_router_topk", "1..num_experts"]),
    ("launch:\n  rollout:\n    nodes: 0\n", ["launch.rollout.nodes", ">= 1"]),
    ("store:\n  flush_seconds: -1\n", ["store.flush_seconds", "> 0"]),
    ("train: [1, 2]\n", ["train", "expected a mapping"]),
    ("- just\n- a list\n", ["bad.yaml", "top level must be a mapping"]),
    ("train:\n  lr: 0.1\n   steps: 3\n", ["bad.yaml", "not valid YAML"]),
]


@pytest.mark.parametrize("text,needles", BAD)
def test_bad_config_message(tmp_path, text, needles):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(config.ConfigError) as ei:
        config.load(p)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(config.ConfigError, match="no such config file"):
        config.load(tmp_path / "nope.yaml")
    with pytest.raises(config.ConfigError, match="key.path=value"):
        config.load(None, ["train.lr"])


def test_cli_reports_config_error(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  lrr: 1\n")
    assert cli_main(["config", "check", str(p)]) == 2
    err = capsys.readouterr().err
    assert "train.lrr" in err and "did you mean" in err


def test_cli_unknown_command(capsys):
    assert cli_main(["stauts"]) == 2
    assert "did you mean 'status'" in capsys.readouterr().err
