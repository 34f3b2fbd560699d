"""SFT in the trainer (``train.mode: sft``, ``neon_hpc/train/sft.py``), real processes and real shards.

One SFT run on a fixed set (8 demonstrations, 8 a step: every step sees the whole set) whose
loss falls; the same run continued to more steps resumes from its checkpoint; an RL trainer
given that checkpoint as ``model.init_checkpoint`` publishes exactly the SFT's weights as its
``v_0``. Also the per-token cross-entropy against a hand computation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neon_hpc.train.loss import sft_loss, sft_term_means
from neon_hpc.util.logs import read_metrics
from repo_paths import REPO

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")


def test_sft_loss_is_the_mean_cross_entropy_of_marked_tokens():
    logp = torch.tensor([[-1.0, float("nan"), -3.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 0]])
    loss, terms = sft_loss(logp, mask, denom=4.0)          # denom: marked tokens of the whole step
    assert loss.item() == pytest.approx((1.0 + 3.0) / 4.0)
    loss.backward()
    assert logp.grad.tolist() == [[-0.25, 0.0, -0.25, 0.0]]
    assert sft_term_means({k: float(v) for k, v in terms.items()})["loss"] == pytest.approx(2.0)


def _trainer(run_dir: Path, *sets: str, mode: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "neon_hpc.train", "--config", CONFIG, "--run-dir", str(run_dir)]
    cmd += ["--mode", mode] if mode else []
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)


@pytest.mark.slow
def test_sft_loss_falls_resumes_and_feeds_rl(tmp_path):
    from neon_hpc import config
    from neon_hpc.envs.xrd.demos import write_demos
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    from neon_hpc.models.hf import read_hf_state_dict
    from neon_hpc.models.tokenizer import load_tokenizer

    cfg = config.load(CONFIG)
    write_demos(tmp_path / "demos", load_tasks("tiny", "train", 0, 8), load_tokenizer("xrd-tiny"), cfg.env, cfg.rollout,
                imperfect=0.0, seed=0)
    sft = tmp_path / "sft"
    common = [f"train.sft_data={tmp_path / 'demos'}", "train.trajectories_per_step=8", "train.lr=0.005",
              "train.checkpoint_every=2", "train.publish_every=2"]
    r = _trainer(sft, "train.steps=4", *common, mode="sft")
    assert r.returncode == 0, r.stderr[-3000:]
    first = {m["step"]: m["loss"] for m in read_metrics(sft, "trainer")}
    assert sorted(first) == [1, 2, 3, 4] and first[4] < first[1] - 0.5, first     # falls on the fixed set
    assert (sft / "checkpoints" / "step_4" / "trainer_state.json").is_file() and (sft / "weights" / "v_4").is_dir()
    step2 = next(m for m in read_metrics(sft, "trainer") if m["step"] == 2)   # written beside the steps, as RL's
    assert "checkpoint_snapshot_s" in step2 and "publish_s" in step2, step2
    assert "checkpoint step_2: snapshot" in r.stderr and "published v_2: snapshot" in r.stderr

    r = _trainer(sft, "train.steps=6", *common, mode="sft")                        # resumes from step_4
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step_4" in r.stderr
    recs = read_metrics(sft, "trainer")
    assert [m["step"] for m in recs] == [1, 2, 3, 4, 5, 6] and all(m["mode"] == "sft" for m in recs)
    assert recs[4]["loss"] < first[4] and recs[-1]["loss"] < first[4], [(m["step"], m["loss"]) for m in recs]

    rl = tmp_path / "rl"    # RL from the SFT checkpoint: its v_0 is the SFT's weights; no rollouts, so it stops
    r = _trainer(rl, f"model.init_checkpoint={sft / 'checkpoints' / 'step_6'}", "train.steps=1",
                 "train.wait_for_data_s=1")
    assert r.returncode == 2 and "initial weights from" in r.stderr, r.stderr[-3000:]
    a, b = read_hf_state_dict(sft / "weights" / "v_6"), read_hf_state_dict(rl / "weights" / "v_0")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad,key", [("train.mode=sft", "train.sft_data"), ("train.mode=dpo", "train.mode"),
                                     ("warm_start.imperfect=1.5", "warm_start.imperfect"),
                                     ("warm_start.steps=0", "warm_start.steps"),
                                     ("eval.num_tasks=-1", "eval.num_tasks")])
def test_config_check_refuses_bad_sft_warm_start_and_eval_keys(bad, key):
    import contextlib
    import io

    from neon_hpc.cli import main as neon_hpc
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = neon_hpc(["config", "check", CONFIG, "--set", bad])
    assert rc == 2 and key in err.getvalue(), err.getvalue()
