"""Pipeline parallelism in the trainer: real processes, megatron-core's 1F1B schedule over gloo.

The data set and the TP=1 reference run are those of ``test_train_loop.py`` (4 steps x 8
packed trajectories of varying length, routes for replay that differ per layer).  A PP=2
run trains the same data: losses and gradient norms within 1e-5 of the reference (the
gradient norm is taken over every parameter of both stages, so a stage that got the wrong
routes, the wrong activations or a mis-scaled loss moves it).  Its step-2 checkpoint resumes
bit-exactly at PP=2 and on the reference's losses at PP=1; its step-4 checkpoint reshards to
the same HF bytes as its direct export.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from neon_hpc.util.logs import read_metrics
from test_train_loop import add_shards, dataset, losses, new_run, reference, start, wait_ok, weights  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def metrics(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run.root, "trainer") if "loss" in r}


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory, dataset):  # noqa: F811
    """Four steps at PP=2 (one rank per stage), checkpoints at steps 2 and 4."""
    run = new_run(tmp_path_factory.mktemp("pp2"), dataset, "run", "train.pipeline_parallel=2")
    add_shards(run, dataset, range(1, 5))
    wait_ok(run, start(run, 2))
    return run


def rewound_copy(run, dst, step: int):
    """A copy of ``run`` as it was right after checkpoint ``step_{step}``: later checkpoints,
    weights and metric records removed (the claims of later steps stay: a restarted trainer
    re-reads exactly those trajectories)."""
    shutil.copytree(run.root, dst)
    from neon_hpc.protocol.rundir import RunDir
    new = RunDir(dst)
    for s in new.checkpoint_steps():
        if s > step:
            shutil.rmtree(new.checkpoint(s))
    for v in new.weight_versions():
        if v > step:
            shutil.rmtree(new.weights_version(v))
    new.publish_latest(step)
    for f in new.root.glob("stdout.*.txt"):
        f.unlink()
    mfile = new.root / "logs" / "trainer" / "metrics.jsonl"
    keep = [line for line in mfile.read_text().splitlines()
            if json.loads(line).get("step", 0) <= step or "loss" not in json.loads(line)]
    mfile.write_text("".join(line + "\n" for line in keep))
    return new


def test_pp2_trains_the_reference_losses_and_gradients(pp2_run, reference):  # noqa: F811
    got, want = metrics(pp2_run), metrics(reference)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5, abs=1e-7)
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=1e-5)
        # the plan feeds the pipeline at least PP micro-batches (1F1B warm-up, steady, cool-down),
        # and every one of them replayed its routes on both stages' layers
        assert got[s]["microbatches"] >= 2
        assert got[s]["replay_docs_missing"] == 0 and got[s]["replayed_microbatches"] >= 2
    a, b = weights(pp2_run, 4), weights(reference, 4)
    assert sorted(a) == sorted(b)
    for k in b:   # Adam's first steps: see test_train_loop.test_parallel_layouts_match_tp1
        d = np.abs(a[k].numpy() - b[k].numpy())
        assert float(d.max()) <= 2 * 0.002 * 4 + 1e-6, k
        assert (d > 1e-5).mean() < 1e-3, k


def test_pp2_resume_at_pp2_is_bit_exact(tmp_path, pp2_run):
    run = rewound_copy(pp2_run, tmp_path / "run", 2)
    wait_ok(run, start(run, 2))
    got, want = metrics(run), metrics(pp2_run)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s]["loss"] == want[s]["loss"] and got[s]["grad_norm"] == want[s]["grad_norm"]
    a, b = weights(run, 4), weights(pp2_run, 4)
    for k in b:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy(), err_msg=k)
    log = "\n".join(p.read_text() for p in run.root.glob("logs/trainer/*.log"))
    assert "rng restored" in log


def test_pp2_checkpoint_resumes_at_pp1(tmp_path, pp2_run, reference):  # noqa: F811
    run = rewound_copy(pp2_run, tmp_path / "run", 2)
    wait_ok(run, start(run, 1, "train.pipeline_parallel=1"))
    got, want = metrics(run), metrics(reference)
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5, abs=1e-7)
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=1e-4)
    log = "\n".join(p.read_text() for p in run.root.glob("logs/trainer/*.log"))
    assert "reseeded: layout changed" in log


def test_reshard_reads_a_pp2_checkpoint(tmp_path, pp2_run):
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models.hf import hf_config, read_hf_state_dict
    from neon_hpc.reshard.pipeline import convert

    out = tmp_path / "hf"
    convert(str(pp2_run.checkpoint(4)), str(out), hf_config=hf_config(ModelConfig()).to_dict(), use_mpi=False)
    got, want = read_hf_state_dict(out), weights(pp2_run, 4)     # weights/v_4: the direct export
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)
