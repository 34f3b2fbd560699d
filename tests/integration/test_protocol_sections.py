"""Each role reads its own keys (issue 23 items 2 and 5): the simulator's validation models the
run's own poll intervals (its config's ``protocol`` section, not constants of three modules);
the rollout node waits for weights ``rollout.wait_for_weights_s``, not the trainer's
``train.wait_for_data_s``; the tokenizer is the ``model.tokenizer`` key, and ``config check``
refuses one the worker could not load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from neon_hpc import config
from neon_hpc.config_cli import role_problems
from neon_hpc.protocol.rundir import RunDir
from repo_paths import REPO

TINY = str(REPO / "configs" / "tiny_cpu.yaml")


def _synthetic_run(root: Path, sets: list[str]) -> Path:
    """A finished run's files, enough for compare_with_run: run.yaml and both roles' metrics."""
    cfg = config.load(TINY, ["rollout.num_workers=2", "rollout.group_size=2", "train.trajectories_per_step=4"] + sets)
    run = RunDir(root).create()
    run.run_yaml.write_text(config.dump(cfg))
    for role in ("trainer", "rollout"):
        run.log_dir(role).mkdir(parents=True, exist_ok=True)
    with open(run.log_dir("trainer") / "metrics.jsonl", "w") as f:
        for s in range(1, 7):
            f.write(json.dumps({"time": 1000.0 + 10 * s, "step": s, "version": s, "step_time_s": 10.0,
                                "wait_s": 6.0, "trajectories": 4, "staleness_mean": 0.5, "staleness_max": 1}) + "\n")
    with open(run.log_dir("rollout") / "metrics.jsonl", "w") as f:
        for g in range(8):
            for w in range(2):
                for _ in range(2):
                    f.write(json.dumps({"time": 1000.0 + 10 * (g + 1), "worker": w, "task_id": f"t{g}-{w}",
                                        "episode_s": 10.0, "version_min": g, "version_max": g}) + "\n")
    return run.root


def test_validation_models_the_runs_own_poll_intervals(tmp_path):
    from neon_hpc.plan.validate import compare_with_run
    root = _synthetic_run(tmp_path / "run", ["protocol.admission_poll_s=0.7", "protocol.claim_poll_s=0.05",
                                             "protocol.weight_poll_s=1.5"])
    report = compare_with_run(root, seeds=1)
    p = report.params
    assert (p.params.admission_poll_s, p.params.claim_poll_s, p.params.weight_poll_s) == (0.7, 0.05, 1.5)
    assert p.source("admission_poll_s") == f"config {root / 'run.yaml'}: protocol.admission_poll_s"
    # a run from before the protocol section: its run.yaml has none, the defaults are the old constants
    old = _synthetic_run(tmp_path / "old", [])
    text = (old / "run.yaml").read_text()
    (old / "run.yaml").write_text(text[:text.index("protocol:")])
    q = compare_with_run(old, seeds=1).params.params
    assert (q.admission_poll_s, q.claim_poll_s, q.weight_poll_s) == (0.25, 0.2, 0.5)


def test_the_node_waits_for_weights_by_its_own_key(tmp_path):
    """A real rollout node with no trainer: it gives up after rollout.wait_for_weights_s, though
    train.wait_for_data_s would have it wait ten minutes."""
    root = tmp_path / "run"
    cfg = config.load(TINY, ["rollout.wait_for_weights_s=1", "train.wait_for_data_s=600",
                             "protocol.weight_poll_s=0.1"])
    run = RunDir(root).create()
    run.run_yaml.write_text(config.dump(cfg))
    code = ("import sys; from neon_hpc import config; from neon_hpc.rollout.node import RolloutNode; "
            "from neon_hpc.rollout.sections import NodeSections; "
            "sys.exit(RolloutNode(NodeSections.of(config.load(sys.argv[1])), sys.argv[2]).run_forever())")
    out = subprocess.run([sys.executable, "-c", code, str(run.run_yaml), str(root)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, NEON_NODE_RANK="0", NEON_NODE_COUNT="1"))
    assert out.returncode != 0
    assert f"no weights in {run.latest_file} after 1s" in out.stderr, out.stderr[-2000:]


def test_the_tokenizer_is_a_key_and_config_check_refuses_one_that_cannot_load(tmp_path):
    def tokenizer_problems(*sets):
        return [m for role, m in role_problems(config.load(TINY, list(sets))) if "tokenizer" in m]

    assert config.load(TINY).model.tokenizer == "xrd-tiny"          # the default: today's tiny runs
    assert tokenizer_problems() == []
    # a vocabulary over 256 is no longer a reason to look elsewhere: the key says which tokenizer
    assert tokenizer_problems("model.vocab_size=512") == []
    (missing,) = tokenizer_problems(f"model.tokenizer={tmp_path / 'nowhere'}")
    assert "model.tokenizer" in missing and "does not exist" in missing
    (empty,) = tokenizer_problems("model.tokenizer=")
    assert "model.init_checkpoint is empty" in empty
    folder = tmp_path / "tok"
    folder.mkdir()
    assert tokenizer_problems(f"model.tokenizer={folder}") == []
