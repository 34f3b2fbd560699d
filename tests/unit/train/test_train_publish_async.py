"""Publishing beside the steps (``train.publish.BackgroundPublisher``): the step pays for the
snapshot only, ``LATEST`` names a version only once its directory is complete, a newer snapshot
replaces one still waiting (never two queued), errors reach the trainer's thread, and what
each version cost is recorded.  The model side is replaced by stand-ins (a dict of tensors
for the gather, a writer that sleeps), so the tests time the queue, not a model.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from neon_hpc.protocol.rundir import RunDir
from neon_hpc.train import publish as P


@pytest.fixture
def run(tmp_path):
    return RunDir(str(tmp_path / "run")).create()


@pytest.fixture
def slow_writer(monkeypatch):
    """``save_hf`` that takes ``delay`` seconds and writes a marker file; gather returns the version."""
    state = SimpleNamespace(delay=0.0, gate=threading.Event(), started=[], fail_on=None)
    state.gate.set()

    def gather(be):
        return {"w": torch.full((2,), float(be.version))}

    def save_hf(sd, cfg, out_dir):
        state.started.append(int(sd["w"][0]))
        state.gate.wait(10)
        time.sleep(state.delay)
        if state.fail_on == int(sd["w"][0]):
            raise OSError("disk full")
        staging = out_dir.parent / (out_dir.name + ".staging")
        staging.mkdir(parents=True)
        (staging / "model.safetensors").write_text(str(sd["w"].tolist()))
        staging.rename(out_dir)
        return out_dir

    monkeypatch.setattr(P, "full_state_dict", gather)
    monkeypatch.setattr(P, "megatron_to_hf", lambda sd, cfg: sd)
    monkeypatch.setattr(P, "save_hf", save_hf)
    return state


def be_at(version):
    return SimpleNamespace(version=version)


def test_the_step_pays_only_for_the_snapshot_and_latest_follows_complete_versions(run, slow_writer):
    slow_writer.delay = 0.3
    pub = P.BackgroundPublisher(run, model_cfg=None, rank=0)
    t0 = time.perf_counter()
    pub.submit(be_at(1), 1)
    assert time.perf_counter() - t0 < 0.2                      # the write runs beside
    assert run.latest_weights() is None                        # not complete yet: engines still see nothing
    pub.drain()
    assert run.latest_weights()[0] == 1 and (run.weights_version(1) / "model.safetensors").is_file()
    (rec,) = pub.completed()
    assert rec.written and rec.version == 1 and rec.write_s >= 0.3 and rec.snapshot_s < 0.2
    pub.close()


def test_a_newer_snapshot_replaces_the_waiting_one(run, slow_writer):
    slow_writer.gate.clear()                                   # the writer blocks inside v_1's write
    pub = P.BackgroundPublisher(run, model_cfg=None, rank=0)
    pub.submit(be_at(1), 1)
    while not slow_writer.started:
        time.sleep(0.01)
    pub.submit(be_at(2), 2)                                    # waits
    pub.submit(be_at(3), 3)                                    # replaces v_2
    slow_writer.gate.set()
    pub.close()
    recs = {r.version: r for r in pub.completed()}
    assert recs[2].superseded and not recs[2].written
    assert recs[1].written and recs[3].written
    assert run.weight_versions() == [1, 3] and run.latest_weights()[0] == 3
    assert slow_writer.started == [1, 3]


def test_an_existing_version_is_kept_and_errors_reach_the_trainer(run, slow_writer):
    pub = P.BackgroundPublisher(run, model_cfg=None, rank=0)
    pub.submit(be_at(1), 1)
    pub.drain()
    pub.submit(be_at(1), 1)                                    # a re-run step: v_1 exists, kept
    pub.drain()
    assert [r.written for r in pub.completed()] == [True, False]
    slow_writer.fail_on = 2
    pub.submit(be_at(2), 2)
    with pytest.raises(P.PublishError, match="disk full"):
        pub.drain()
    assert run.latest_weights()[0] == 1 and not run.weights_version(2).exists()
    pub.close()


def test_other_ranks_only_take_part_in_the_gather(run, slow_writer):
    pub = P.BackgroundPublisher(run, model_cfg=None, rank=1)
    pub.submit(be_at(1), 1)
    pub.close()
    assert run.latest_weights() is None and pub.completed() == []


def test_the_snapshot_is_a_copy_not_the_live_parameters():
    """The writer reads the snapshot while the next optimizer step changes the parameters: the
    gathered state must not share storage with them (CPU ``.cpu()`` would have returned the
    parameters themselves)."""
    from neon_hpc import config as C
    from neon_hpc.train import backend as B
    from repo_paths import REPO as repo
    cfg = C.load(repo / "configs" / "tiny_cpu.yaml")
    be = B.setup(cfg.model, lr=1e-3, seed=3)
    try:
        full = B.full_state_dict(be)
        before = {k: v.clone() for k, v in full.items()}
        with torch.no_grad():
            for m in be.models:
                for p in m.parameters():
                    p.add_(1.0)
        assert all(torch.equal(full[k], before[k]) for k in full)
    finally:
        B.teardown()
