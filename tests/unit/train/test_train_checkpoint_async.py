"""Checkpoints beside the steps (``train.checkpoint.AsyncCheckpointer``): the step returns before
the write does, a checkpoint is visible only once complete, a writer's error reaches the trainer's
thread, and what the background wrote loads bit-identical to the synchronous save of the same
weights.  Real megatron-core (one gloo rank) and real torch_dist files; the slow or failing
writer is megatron's own bucket writer behind a gate the test holds (ordering by events, never
by the clock).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from neon_hpc import config as C
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.store.synthetic import make_trajectory
from neon_hpc.train import backend as B, checkpoint as ck
from repo_paths import REPO


@pytest.fixture(scope="module")
def trained():
    """A backend after two real optimizer steps (so the optimizer holds Adam moments)."""
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.loss import loss_settings
    from neon_hpc.train.sections import TrainerSections

    cfg = C.load(REPO / "configs" / "tiny_cpu.yaml")
    sec = TrainerSections.of(cfg)
    be = B.setup(cfg.model, lr=1e-3, seed=3, replay=False)
    rng = np.random.default_rng(0)

    def step():
        trajs = [make_trajectory(rng, 24, routes=False, vocab=cfg.model.vocab_size, group_id=f"g{i // 2}",
                                 task_id=f"g{i // 2}") for i in range(4)]
        train_step(be, prepare_step(trajs, 1, sec), loss_settings(sec))

    step()
    step()
    be.step = step
    try:
        yield be
    finally:
        B.teardown()


@pytest.fixture
def gated(monkeypatch):
    """The writer thread's bucket writes wait for ``gate``; ``started`` is set when they begin;
    ``fail`` set: they raise instead of writing."""
    gate, started = threading.Event(), threading.Event()
    box = {"fail": None}
    real = ck._write_buckets

    def write(request):
        started.set()
        assert gate.wait(60), "the test never opened the gate"
        if box["fail"] is not None:
            raise box["fail"]
        return real(request)

    monkeypatch.setattr(ck, "_write_buckets", write)
    return gate, started, box


def run_dir(tmp_path, name):
    return RunDir(str(tmp_path / name)).create()


def test_the_step_returns_before_the_write_and_the_checkpoint_appears_only_complete(tmp_path, trained, gated):
    gate, started, _ = gated
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained)
    saver.submit(4, {"version": 4})
    assert started.wait(60)                     # the write began on its thread ...
    assert not gate.is_set()                    # ... and submit returned while it is held
    assert saver.in_flight == 4
    assert not run.checkpoint(4).exists() and ck.latest_complete(run) is None
    assert saver.poll() is None                 # still writing: nothing finalized, nothing visible
    assert not run.checkpoint(4).exists()
    gate.set()
    rec = saver.wait()
    assert rec.step == 4 and rec.error is None and saver.in_flight is None
    assert ck.latest_complete(run) == 4
    assert sorted(p.name for p in run.checkpoint(4).iterdir()) == sorted(
        [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json", "integrity.json",
         "config.json", "trainer_state.json", "rng"])
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]   # no staging left


def test_a_second_checkpoint_waits_for_the_first_and_resume_takes_the_newest_complete(tmp_path, trained, gated):
    gate, started, _ = gated
    gate.set()
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained)
    saver.submit(1, {"version": 1})
    saver.submit(2, {"version": 2})             # one in flight: step_1 is finalized first
    assert ck.latest_complete(run) == 1 and saver.in_flight == 2
    gate.clear()
    started.clear()
    saver.wait()
    saver.submit(3, {"version": 3})             # held: a crash now leaves step_3 half-written, hidden
    assert started.wait(60)
    assert ck.latest_complete(run) == 2 and not run.checkpoint(3).exists()
    digest = B.param_digest(trained)
    state = ck.load(run, trained, ck.latest_complete(run))
    assert state["step"] == 2 and state["digests_verified"] and state["optimizer_restored"]
    assert B.param_digest(trained) == digest
    gate.set()
    saver.wait()
    assert ck.latest_complete(run) == 3


@pytest.mark.parametrize("hold, where, error", [("gated", "writer thread", "OSError"),
                                               ("held_seal", "seal thread", "StorageError")], ids=["write", "seal"])
def test_an_error_beside_the_steps_is_raised_on_the_trainer_thread_and_nothing_is_published(tmp_path, trained,
                                                                                            request, hold, where,
                                                                                            error):
    """A full disk in the writer's bucket writes or in rank 0's seal: raised at the next wait, nothing
    visible, staging removed, and the next checkpoint is written normally."""
    gate, started, box = request.getfixturevalue(hold)
    box["fail"] = OSError(28, "No space left on device")
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained)
    saver.submit(5, {"version": 5})
    gate.set()
    with pytest.raises(ck.CheckpointWriteError, match=rf"step_5 failed on the {where} of rank 0: {error}"):
        saver.wait()
    assert not run.checkpoint(5).exists() and ck.latest_complete(run) is None
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]   # staging removed
    assert saver.in_flight is None
    (rec,) = saver.completed()
    assert "No space left" in rec.error
    box["fail"] = None
    saver.submit(6, {"version": 6})             # the next one is written normally
    saver.wait()
    assert ck.latest_complete(run) == 6


def test_the_snapshot_is_what_is_written_and_it_loads_bit_identical_to_the_synchronous_save(tmp_path, trained,
                                                                                           gated):
    gate, started, _ = gated
    sync_run, async_run = run_dir(tmp_path, "sync"), run_dir(tmp_path, "async")
    ck.save(sync_run, trained, 7, {"version": 7})
    saved = {k: v.clone() for k, v in B.full_state_dict(trained).items()}
    saver = ck.AsyncCheckpointer(async_run, trained)
    saver.submit(7, {"version": 7})
    assert started.wait(60)
    trained.step()                              # the next step changes weights and moments meanwhile
    changed = B.param_digest(trained)
    gate.set()
    saver.wait()
    got = {}
    for run in (sync_run, async_run):
        state = ck.load(run, trained, 7)
        assert state["param_digest_checked"] and state["digests_verified"] and state["optimizer_restored"]
        full = B.full_state_dict(trained)
        assert all(torch.equal(full[k], saved[k]) for k in saved)   # the weights of step 7, not later ones
        moments = {}
        for i, o in enumerate(trained.optimizer.chained_optimizers):
            for j, st in enumerate(o.optimizer.state.values()):
                moments.update({f"{i}.{j}.{n}": t.clone() for n, t in st.items() if isinstance(t, torch.Tensor)})
        got[run.root.name] = (B.param_digest(trained), moments)
    assert got["sync"][0] == got["async"][0] != changed
    assert got["sync"][1].keys() == got["async"][1].keys() and got["sync"][1]
    assert all(torch.equal(got["sync"][1][k], got["async"][1][k]) for k in got["sync"][1])


def test_later_saves_reuse_megatron_s_cached_plan_on_the_writer_thread_and_still_load_bit_identical(
        tmp_path, trained, monkeypatch):
    """From the third save of an unchanged structure megatron reuses its plan (cached_metadata), the
    sharding is not validated again, and its save (no collective left in it) runs on the writer
    thread; what those saves wrote is the snapshot's (the next step ran meanwhile) and loads as the
    synchronous save of the same weights does (the .metadata they leave passes the allowlist
    unpickler)."""
    from megatron.core import dist_checkpointing

    run, ref = run_dir(tmp_path, "async"), run_dir(tmp_path, "sync")
    saver = ck.AsyncCheckpointer(run, trained)
    strategies, validated, beside, threads = [], [], [], []
    real, real_save = ck.AsyncCheckpointer._save_strategy, dist_checkpointing.save

    def spy(self, snap):
        out = real(self, snap)
        strategies.append(out[0])
        validated.append(out[1])
        beside.append(out[2])
        return out

    def save_spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ck.AsyncCheckpointer, "_save_strategy", spy)
    monkeypatch.setattr(dist_checkpointing, "save", save_spy)
    for step in (1, 2, 3):
        trained.step()
        saver.submit(step, {"version": step})
        saver.wait()
    trained.step()
    saved = {k: v.clone() for k, v in B.full_state_dict(trained).items()}
    ck.save(ref, trained, 4, {"version": 4})
    saver.submit(4, {"version": 4})
    trained.step()                              # changes weights and moments before the thread saves
    saver.wait()
    assert validated == [True, False, False, False] and beside == [False, False, True, True]
    assert threads == ["MainThread", "MainThread", "neon-ckpt-3", "MainThread", "neon-ckpt-4"]   # 4th: ck.save
    assert len({id(s) for s in strategies}) == 1 and strategies[0].validated_cache_reuse   # the plan came from cache
    for r in (run, ref):
        state = ck.load(r, trained, 4)
        assert state["param_digest_checked"] and state["digests_verified"] and state["optimizer_restored"]
        assert state["rng_restored"]
        full = B.full_state_dict(trained)
        assert all(torch.equal(full[k], saved[k]) for k in saved), r.root.name
    assert torch.equal(torch.load(run.checkpoint(4) / "rng" / "rank_0.pt")["torch"],
                       torch.load(ref.checkpoint(4) / "rng" / "rank_0.pt")["torch"])


def test_a_changed_structure_gets_a_fresh_strategy_and_is_validated(tmp_path, trained):
    saver = ck.AsyncCheckpointer(run_dir(tmp_path, "run"), trained)
    snap = ck.host_snapshot(ck._sharded(trained, is_loading=False))
    first, v1, _ = saver._save_strategy(snap)
    same, v2, _ = saver._save_strategy(ck.host_snapshot(ck._sharded(trained, is_loading=False)))
    del snap["optimizer"]                      # a state with one part fewer: another plan
    other, v3, _ = saver._save_strategy(snap)
    assert (v1, v2, v3) == (True, False, True) and first is same and other is not first


def test_a_write_stuck_past_the_deadline_is_raised_at_the_next_boundary_and_nothing_is_published(tmp_path, trained,
                                                                                                gated):
    gate, started, _ = gated
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained, write_timeout_s=3600.0)
    saver.submit(3, {"version": 3})
    assert started.wait(60)
    assert saver.poll() is None and saver.in_flight == 3      # still writing, within its deadline
    saver.write_timeout_s = 0.0                                # the deadline passes (a hung mount)
    pending = saver._pending
    with pytest.raises(ck.CheckpointWriteError, match=r"step_3 still writing on rank 0 0s after it began "
                                                      r"\(train.checkpoint_write_timeout_s\); nothing was published"):
        saver.poll()
    assert saver.in_flight is None and not run.checkpoint(3).exists()
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]   # staging removed
    (rec,) = saver.completed()
    assert "still writing" in rec.error
    gate.set()                                                 # the stuck thread ends on its own
    pending.thread.join(60)
    assert not pending.thread.is_alive() and not run.checkpoint(3).exists()


def test_the_parameter_digest_is_summed_on_the_writer_thread_from_the_snapshot(tmp_path, trained, monkeypatch):
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained)

    def not_on_the_step(be):
        raise AssertionError("param_digest ran on the step")

    with monkeypatch.context() as m:
        m.setattr(ck, "param_digest", not_on_the_step)
        saver.submit(9, {"version": 9})
        saved = B.param_digest(trained)
        trained.step()                              # changes the weights before the writer sums
        saver.wait()
    assert ck.read_state(run.checkpoint(9))["param_digest_rank0"] == saved != B.param_digest(trained)
    assert ck.load(run, trained, 9)["param_digest_checked"]


def test_the_sharded_state_formats_no_tensor(trained, monkeypatch):
    """megatron's optimizer mapping builds a debug message from each tensor a chained optimizer's part
    does not track (whatever the log level); with the tensor's values printed that is a host sync
    per tensor on CUDA.  Building the state dict of a save (and of a load) formats no tensor;
    outside it megatron's factories print as megatron prints them."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    assert len(trained.optimizer.chained_optimizers) > 1       # the case that formats tensors
    formatted = []
    real = torch._tensor_str._str
    monkeypatch.setattr(torch._tensor_str, "_str", lambda t, *a, **k: formatted.append(t.shape) or real(t, *a, **k))
    megatron_repr = ShardedTensorFactory.__repr__
    for loading in (False, True):
        sd = ck._sharded(trained, is_loading=loading)
        assert formatted == [], (loading, formatted[:4])
    factory = next(v for v in nested_values(sd) if isinstance(v, ShardedTensorFactory))
    assert ShardedTensorFactory.__repr__ is megatron_repr and "tensor(" in repr(factory) and formatted


@pytest.fixture
def held_seal(monkeypatch):
    """Rank 0's seal (``checkpoint._seal``, on its thread) waits for ``gate``; ``started`` is set when
    it begins; ``fail`` set: it raises instead of sealing."""
    gate, started = threading.Event(), threading.Event()
    box = {"fail": None}
    real = ck._seal

    def seal(*args):
        started.set()
        assert gate.wait(60), "the test never opened the gate"
        if box["fail"] is not None:
            raise box["fail"]
        return real(*args)

    monkeypatch.setattr(ck, "_seal", seal)
    return gate, started, box


def test_the_seal_runs_beside_the_step_and_the_checkpoint_appears_only_once_sealed(tmp_path, trained, held_seal):
    gate, started, _ = held_seal
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained)
    saver.submit(4, {"version": 4})
    saver._pending.done.wait(60)                # the writer thread is done ...
    assert saver.poll() is None                 # ... so this boundary finalizes and hands over the seal
    assert started.wait(60) and saver.in_flight == 4
    trained.step()                              # a step while rank 0 seals
    assert saver.poll() is None and not run.checkpoint(4).exists() and ck.latest_complete(run) is None
    gate.set()
    saver._pending.sealed.wait(60)
    rec = saver.poll()                          # the boundary after the seal: published, its record
    assert rec.step == 4 and rec.error is None and rec.seal_s > 0 and saver.in_flight is None
    assert ck.latest_complete(run) == 4
    assert ck.load(run, trained, 4)["digests_verified"]
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]


def test_a_seal_stuck_past_the_deadline_is_raised_and_its_folder_is_left_to_it(tmp_path, trained, held_seal):
    gate, started, _ = held_seal
    run = run_dir(tmp_path, "run")
    saver = ck.AsyncCheckpointer(run, trained, write_timeout_s=3600.0)
    saver.submit(3, {"version": 3})
    saver._pending.done.wait(60)
    assert saver.poll() is None and started.wait(60)
    pending = saver._pending
    saver.write_timeout_s = 0.0                                # the deadline passes (a hung mount)
    with pytest.raises(ck.CheckpointWriteError, match=r"step_3 still sealing on rank 0 0s after it began"):
        saver.poll()
    assert saver.in_flight is None and not run.checkpoint(3).exists()
    assert pending.staging.exists()             # not removed under a seal that may be renaming it
    gate.set()                                  # the seal ends on its own: what it publishes is complete
    pending.sealer.join(60)
    assert ck.latest_complete(run) == 3 and ck.load(run, trained, 3)["digests_verified"]
