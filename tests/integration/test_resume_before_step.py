"""A checkpoint saved before the first optimizer step resumes (issue 20).

``train.publish_via=reshard`` saves ``checkpoints/step_0`` at start (the reshard converts it into
``weights/v_0``), before any optimizer step: Adam has no exp_avg/exp_avg_sq yet, and megatron's
loading template asked for them (``KeyError: exp_avg``), so a trainer killed while it waited
for its first data could never start again on that run directory. Now it resumes from step_0
and trains the same losses and weights as an uninterrupted run (the reference of
``test_train_loop``: same data, same initial weights)."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from neon_hpc.checkpoint.metadata import load_dcp_metadata
from neon_hpc.train import checkpoint as ckpt
from test_train_loop import add_shards, beat, dataset, losses, new_run, reference, start, wait_for, wait_ok, weights  # noqa: F401 (fixtures)


@pytest.mark.slow
def test_a_checkpoint_from_before_the_first_step_resumes_to_the_uninterrupted_run(tmp_path, dataset, reference):  # noqa: F811
    run = new_run(tmp_path, dataset, "run", "train.steps=2", "train.publish_via=reshard")
    procs = start(run)   # no data yet: step_0 + v_0, then it waits for step 1's data
    wait_for(lambda: run.checkpoint_steps() == [0] and run.latest_weights() is not None
             and beat(run).get("step") == 1, "step_0 checkpoint and the wait for step 1", procs)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()

    add_shards(run, dataset, [1, 2])
    procs = start(run)
    wait_ok(run, procs)               # was: KeyError 'exp_avg' in megatron's optimizer load
    assert not ckpt.has_optimizer_moments(load_dcp_metadata(run.checkpoint(0) / ".metadata")), \
        "step_0 was saved before any optimizer step: it should hold no Adam moments"
    log = (run.root / "logs" / "trainer" / "0.log").read_text()
    assert "resumed from" in log and "step 0" in log, log[-2000:]
    assert run.checkpoint_steps() == [0, 1, 2]
    meta = load_dcp_metadata(run.checkpoint(2) / ".metadata")
    assert ckpt.has_optimizer_moments(meta), "step_2 comes after two Adam steps: its moments must be saved"
    got = losses(run)
    assert sorted(got) == [1, 2]
    for s in (1, 2):
        assert got[s] == losses(reference)[s]
    a, b = weights(run, 2), weights(reference, 2)
    for k in b:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy(), err_msg=k)
