"""The main job with the trainer in bf16 (`neon-hpc run configs/tiny_cpu.yaml --set
train.precision=bf16`), as local processes, shortened (a few RL steps, a small warm start and
eval): it completes, the SFT warm start and RL both ran bf16 (logged, recorded in their
checkpoints), the published weights are bf16, every document replayed its routes."""

from __future__ import annotations

import json

import pytest

from mainjob import run_main_job
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import read_metrics

pytestmark = pytest.mark.slow
STEPS = 3


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return run_main_job(tmp_path_factory, "e2e_bf16", "tiny_cpu.yaml", f"train.steps={STEPS}",
                        "train.checkpoint_every=2", "train.precision=bf16", "warm_start.demos=32", "warm_start.steps=4",
                        "eval.num_tasks=4")


def test_bf16_main_job_completes(finished_run):
    assert finished_run["rc"] == 0, finished_run["out"][-3000:]
    trainer = [r for r in read_metrics(finished_run["root"], "trainer") if "loss" in r]
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    assert all(r["replay_docs_missing"] == 0 for r in trainer)
    log = (finished_run["root"] / "logs" / "trainer" / "0.log").read_text()
    assert "precision=bf16" in log and '"grouped_gemm": "torch._grouped_mm"' in log


def test_checkpoints_record_bf16_and_weights_are_bf16(finished_run):
    from safetensors import safe_open
    run = RunDir(finished_run["root"])
    state = json.loads((run.checkpoint(2) / "trainer_state.json").read_text())
    assert state["precision"] == "bf16"
    sft = sorted((finished_run["root"] / "warm_start").rglob("trainer_state.json"))
    assert sft and all(json.loads(p.read_text())["precision"] == "bf16" for p in sft)
    with safe_open(str(run.weights_version(STEPS) / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}, dtypes
    assert json.loads((run.weights_version(STEPS) / "config.json").read_text())["dtype"] == "bfloat16"
