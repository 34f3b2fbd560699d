"""What a relaunch cleans up and how it counts (issue 20, faults 4 and 5): staging siblings of
dead checkpoint and weight writers are swept at start; the summary counts distinct steps."""

from __future__ import annotations

import json
import os

from neon_hpc import config
from neon_hpc.launch.common import prepare_run, write_run_yaml
from neon_hpc.launch.summary import summarize
from neon_hpc.protocol.rundir import staging_dir_for
from repo_paths import REPO

TINY = REPO / "configs" / "tiny_cpu.yaml"


def test_a_relaunch_sweeps_checkpoint_and_weight_staging_of_dead_writers(tmp_path):
    run = write_run_yaml(config.load(TINY), str(tmp_path / "r"))[0]
    ckpt_tmp = staging_dir_for(run.checkpoint(4))          # what a killed trainer's save leaves
    (ckpt_tmp / "__0_0.distcp").write_bytes(b"half")
    weights_tmp = staging_dir_for(run.weights_version(3))
    (weights_tmp / "model.safetensors").write_bytes(b"half")
    run.checkpoint(2).mkdir()
    (run.checkpoint(2) / "trainer_state.json").write_text("{}")
    run.weights_version(2).mkdir()
    prepare_run(config.load(TINY), str(tmp_path / "r"), "local")
    assert sorted(os.listdir(run.checkpoints)) == ["step_2"]
    assert sorted(os.listdir(run.weights)) == ["v_2"]


def test_the_summary_counts_each_step_once_after_a_resume(tmp_path):
    run = write_run_yaml(config.load(TINY), str(tmp_path / "r"))[0]
    d = run.log_dir("trainer")
    d.mkdir(parents=True)
    # steps 1-5, killed after step 5 with the newest checkpoint at 4: steps 5-8 after the resume
    recs = [{"step": s, "time": 100.0 + s, "trajectories": 16, "tokens": 10 * s, "reward_mean": 0.1 * s,
             "wait_s": 1.0, "step_time_s": 2.0} for s in (1, 2, 3, 4, 5, 5, 6, 7, 8)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = summarize(run.root)
    assert s["steps"] == 8
    assert s["trajectories_trained"] == 8 * 16
    assert s["tokens_trained"] == sum(10 * k for k in range(1, 9))
    assert s["trainer_idle_fraction"] == 1.0 / 3.0
