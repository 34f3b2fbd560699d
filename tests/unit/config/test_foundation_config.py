"""Config errors name the file, the key path, what was expected, and the fix."""

from __future__ import annotations

import pytest

from neon_hpc import config
from neon_hpc.cli import main as cli_main
from repo_paths import REPO


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "kimi_k2_1300xh200.yaml"])
def test_shipped_configs_validate(name):
    cfg = config.load(REPO / "configs" / name)
    assert cfg.offpolicy.correction == "tis"
    # round trip: the resolved config dumps to YAML that loads to the same object
    assert config.from_dict(config.to_dict(cfg)) == cfg


def test_override_sets_typed_value():
    cfg = config.load(REPO / "configs" / "tiny_cpu.yaml", ["train.lr=1e-4", "rollout.group_size=8"])
    assert cfg.train.lr == pytest.approx(1e-4) and cfg.rollout.group_size == 8


BAD = [
    # (yaml text, substrings the message must contain)
    ("train:\n  lrr: 0.1\n", ["bad.yaml", "train.lrr", "unknown key", "did you mean 'train.lr'"]),
    ("train:\n  steps: many\n", ["bad.yaml", "train.steps", "expected int", "'many'"]),
    ("offpolicy:\n  replay_engine: delt\n",
     ["offpolicy.replay_engine", "one of 'delta', 'full', 'off'", "did you mean 'delta'"]),
    ("offpolicy:\n  correction: none\n", ["offpolicy.correction", "async", "'tis'"]),
    # the keys offpolicy: took over are refused with their new place named
    ("rollout:\n  max_staleness: 2\n", ["rollout.max_staleness", "moved to offpolicy.max_staleness"]),
    ("rollout:\n  stale_policy: drop\n", ["rollout.stale_policy", "moved to offpolicy.stale_policy"]),
    ("rollout:\n  backpressure_steps: 2\n", ["rollout.backpressure_steps", "moved to offpolicy.backpressure_steps"]),
    ("rollout:\n  replay_mode: delta\n", ["rollout.replay_mode", "moved to offpolicy.replay_engine"]),
    ("train:\n  off_policy_correction: tis\n", ["train.off_policy_correction", "moved to offpolicy.correction"]),
    ("train:\n  tis_cap: 2.0\n", ["train.tis_cap", "moved to offpolicy.correction_params.cap"]),
    ("train:\n  router_replay: replay\n", ["train.router_replay", "moved to offpolicy.replay_trainer"]),
    # "router" alone is the MoE router: the HTTP one in front of PD servers is the load balancer
    ("engine:\n  router: rust\n", ["engine.router", "moved to engine.load_balancer"]),
    ("mode: sync\n", ["mode", "moved to schedule"]),
    ("engine:\n  router_port: 8001\n", ["engine.router_port", "moved to engine.load_balancer_port"]),
    # route replay's two ends: the trainer replays only routes the engines export
    ("offpolicy:\n  replay_engine: 'off'\n", ["offpolicy.replay_trainer", "offpolicy.replay_engine: delta",
                                             "offpolicy.replay_trainer: 'off'"]),
    ("offpolicy:\n  correction: 'not a name'\n", ["offpolicy.correction", "pkg.mod:fn"]),
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


def test_schema_command_prints_a_schema_the_shipped_configs_satisfy(capsys):
    """`neon-hpc config schema` is the pydantic model's JSON schema: every section, the model
    section per architecture, ranges and enums; the shipped configs validate against it."""
    import json

    import jsonschema
    import yaml
    assert cli_main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    defs = schema["$defs"]
    assert {"TrainConfig", "Qwen3MoeConfig", "DeepSeekV3Config", "StoreConfig"} <= set(defs)
    assert defs["TrainConfig"]["properties"]["lr"]["exclusiveMinimum"] == 0
    assert defs["TrainConfig"]["properties"]["precision"]["enum"] == ["auto", "bf16", "fp32"]
    assert "kv_lora_rank" in defs["DeepSeekV3Config"]["properties"]
    assert "kv_lora_rank" not in defs["Qwen3MoeConfig"]["properties"]
    for p in sorted((REPO / "configs").glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(p.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"train": {"lrr": 1}}, schema)


def test_model_section_is_the_architectures_own():
    """`model.arch` chooses the section; a field of another architecture is refused with the fix."""
    from neon_hpc.arch.deepseek_v3.config import DeepSeekV3Config
    from neon_hpc.arch.qwen3_moe.config import Qwen3MoeConfig
    from neon_hpc.config.model import ModelConfig
    assert type(config.load(REPO / "configs" / "tiny_cpu.yaml").model) is Qwen3MoeConfig
    dsv3 = config.load(REPO / "configs" / "tiny_dsv3_cpu.yaml").model
    assert type(dsv3) is DeepSeekV3Config and dsv3.kv_lora_rank >= 1 and dsv3.hidden_size > 0
    assert type(ModelConfig(arch="kimi_k2")) is DeepSeekV3Config and type(ModelConfig()) is Qwen3MoeConfig
    with pytest.raises(config.ConfigError, match=r"model.first_dense_layers: a field of arch deepseek_v3, not of "
                                                 r"arch qwen3_moe: remove it, or set model.arch: deepseek_v3"):
        config.load(REPO / "configs" / "tiny_cpu.yaml", ["model.first_dense_layers=1"])
    with pytest.raises(config.ConfigError, match=r"model.arch: expected one of 'qwen3_moe', 'deepseek_v3', "
                                                 r"'kimi_k2', got 'qwen3'; did you mean 'qwen3_moe'\?"):
        config.load(None, ["model.arch=qwen3"])
    with pytest.raises(config.ConfigError, match=r"model: expected a mapping"):
        config.load(None, ["model=3"])


def test_a_run_yaml_written_before_the_split_still_loads(tmp_path):
    """Old run.yaml files list every DeepSeek-V3 field under qwen3_moe, at its neutral value:
    a resumed run loads them; a real value is still refused by name."""
    import yaml
    old = yaml.safe_load(config.dump(config.load(REPO / "configs" / "tiny_cpu.yaml")))
    old["model"].update(q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
                        first_dense_layers=0, num_shared_experts=0, router_groups=1, router_group_topk=1,
                        routed_scaling_factor=1.0, yarn_factor=0.0, yarn_original_max_position_embeddings=4096,
                        yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0)
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(old))
    assert config.load(p) == config.load(REPO / "configs" / "tiny_cpu.yaml")
    with pytest.raises(config.ConfigError, match=r"model.kv_lora_rank: a field of arch deepseek_v3"):
        config.load(p, ["model.kv_lora_rank=512"])
