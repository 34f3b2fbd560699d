"""The trainer as the launcher runs it: real processes on a real run directory.

One fixed data set (4 steps x 8 trajectories in HDF5 shards, routes for replay, mixed
weight versions) and one set of initial HF weights; a TP=1 reference run trains on it, and
the other tests compare against that reference: a run killed with SIGKILL and preempted with
SIGUSR1 resumes to the same weights; TP=2 and EP=2 (DP=2) over gloo reach the same losses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from neon_hpc import config as C
from neon_hpc.protocol.rundir import RunDir, read_json
from neon_hpc.util.logs import read_metrics
from neon_hpc.util.netutil import free_port

STEPS, PER_STEP = 4, 8
L, K, E = 2, 2, 4


def _trajectories(step: int, rng: np.random.Generator, layers: int = L):
    from neon_hpc.store import Trajectory
    out = []
    for i in range(PER_STEP):
        n = int(rng.integers(6, 18))
        prompt = int(rng.integers(2, 4))
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)
        versions = np.where(mask > 0, rng.integers(max(0, step - 3), step, n), -1).astype(np.int32)
        routes = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(layers)])
                           for _ in range(n)]).astype(np.int32)
        out.append(Trajectory(tokens=rng.integers(0, 256, n).astype(np.int32), loss_mask=mask,
                              logprobs=np.where(mask > 0, rng.normal(-5.5, 0.3, n), 0).astype(np.float32),
                              versions=versions, routed_experts=routes, reward=float(rng.integers(0, 2)),
                              task_id=f"s{step}g{i // 4}", group_id=f"s{step}g{i // 4}"))
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Shard files per step (in claim order) and an HF folder of initial weights."""
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.models.hf import build_hf_model, save_hf
    from neon_hpc.store import ShardWriter

    root = tmp_path_factory.mktemp("train_data")
    init = save_hf(build_hf_model(ModelConfig(), seed=11), ModelConfig(), root / "init_hf")
    scratch = RunDir(root / "scratch").create()
    rng = np.random.default_rng(5)
    shards = []
    w = ShardWriter(scratch.root, "fixture", StoreConfig(flush_trajectories=10 * PER_STEP))
    for step in range(1, STEPS + 1):
        for t in _trajectories(step, rng):
            w.add(t)
        shards.append(w.flush())
        time.sleep(0.002)               # shard names start with a ms timestamp: keep claim order
    return {"init": init, "shards": shards}


def new_run(tmp_path: Path, dataset, name: str, *sets: str) -> RunDir:
    cfg = C.load(None, [f"train.steps={STEPS}", f"train.trajectories_per_step={PER_STEP}",
                        "train.checkpoint_every=2", "train.publish_every=1", "train.lr=0.002",
                        "offpolicy.max_staleness=8", "train.wait_for_data_s=300",
                        f"model.init_checkpoint={dataset['init']}", *sets])
    run = RunDir(tmp_path / name).create()
    run.run_yaml.write_text(C.dump(cfg))
    return run


def add_shards(run: RunDir, dataset, steps) -> None:
    for s in steps:
        src = dataset["shards"][s - 1]
        shutil.copy(src, run.traj_ready / f".{src.name}.tmp")
        os.rename(run.traj_ready / f".{src.name}.tmp", run.traj_ready / src.name)


def start(run: RunDir, world: int = 1, *sets: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        args = [sys.executable, "-m", "neon_hpc.train", "--config", str(run.run_yaml), "--run-dir", str(run.root)]
        for s in sets:
            args += ["--set", s]
        log = open(run.root / f"stdout.{r}.{time.monotonic_ns()}.txt", "w")
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_ok(run: RunDir, procs, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    for p in procs:
        try:
            rc = p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            rc = "timeout"
        if rc != 0:
            logs = "\n".join(f.read_text()[-3000:] for f in sorted(run.root.glob("stdout.*.txt")))
            pytest.fail(f"trainer exited {rc}:\n{logs}")


def wait_for(cond, what: str, procs, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"trainer exited ({[p.returncode for p in procs]}) while waiting for {what}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def beat(run: RunDir) -> dict:
    return read_json(run.heartbeat_file("trainer", 0), default={}) or {}


def losses(run: RunDir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run.root, "trainer") if "loss" in r}


def weights(run: RunDir, version: int) -> dict:
    from neon_hpc.models.hf import read_hf_state_dict
    return read_hf_state_dict(run.weights_version(version))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset):
    run = new_run(tmp_path_factory.mktemp("ref"), dataset, "run")
    add_shards(run, dataset, range(1, STEPS + 1))
    wait_ok(run, start(run))
    return run


def test_reference_run_publishes_checkpoints_and_metrics(reference):
    run = reference
    assert run.weight_versions() == [0, 1, 2, 3, 4] and run.latest_weights()[0] == 4
    assert run.checkpoint_steps() == [2, 4]
    state = json.loads((run.checkpoint(4) / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["cursor"]["next_step"] == 5
    assert (run.checkpoint(4) / ".metadata").is_file()
    recs = [r for r in read_metrics(run.root, "trainer") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        for key in ("version", "step_time_s", "wait_s", "tokens", "trajectories", "tokens_per_s", "reward_mean",
                    "staleness_mean", "staleness_max", "staleness_hist", "pg_loss", "kl_k3", "tis_clip_frac",
                    "mismatch_abs_mean", "grad_norm"):
            assert key in r, key
        assert r["trajectories"] == PER_STEP and r["replay_docs_missing"] == 0 and r["replayed_microbatches"] >= 1
        assert sum(r["staleness_hist"].values()) == r["gen_tokens"]
        # token versions of step s lie in [s-3, s-1]; the trainer's version at step s is s-1
        assert 0 <= r["staleness_max"] <= 2 and (r["step"] == 1 or r["staleness_mean"] > 0)
    # the claim's shards: from the read-ahead's memory or read by the claim; the first claim comes
    # before any read-ahead; every shard was ready at the start, so a later claim finds the one
    # read beside the step before
    assert (recs[0]["read_ahead_hits"], recs[0]["read_ahead_misses"]) == (0, 0)
    assert all(r["read_ahead_hits"] + r["read_ahead_misses"] == r["shards"] for r in recs[1:])
    assert sum(r["read_ahead_hits"] for r in recs[1:]) >= 1
    # the data moved from ready/ to claimed/step_N/, one shard per step, in order
    assert not list(run.traj_ready.glob("*.h5"))
    assert [sorted(p.name for p in run.claimed_step(s).glob("*.h5")) for s in range(1, 5)] == \
        [[p.name] for p in dataset_shards(run)]
    assert not np.allclose(weights(run, 0)["lm_head.weight"].numpy(), weights(run, 4)["lm_head.weight"].numpy())


def dataset_shards(run: RunDir):
    return [next(run.claimed_step(s).glob("*.h5")) for s in range(1, STEPS + 1)]


def test_sigkill_then_sigusr1_resume_continues_exactly(tmp_path, dataset, reference):
    run = new_run(tmp_path, dataset, "run")
    # 1. data for two steps only: the trainer checkpoints step 2, then waits for step 3 -> SIGKILL.
    add_shards(run, dataset, [1, 2])
    procs = start(run)
    wait_for(lambda: run.latest_checkpoint() == 2 and beat(run).get("step") == 3, "step_2 checkpoint", procs)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    assert run.checkpoint_steps() == [2]
    # 2. restart with step 3's data; while it waits for step 4, SIGUSR1 (Slurm's warning signal):
    #    it checkpoints step 3, records the preemption and exits 0 for the requeue.
    add_shards(run, dataset, [3])
    procs = start(run)
    wait_for(lambda: 3 in losses(run) and beat(run).get("step") == 4, "step 3 after resume", procs)
    procs[0].send_signal(signal.SIGUSR1)
    wait_ok(run, procs, timeout=60)
    pre = read_json(run.state / "trainer_preempted.json")
    assert pre["step"] == 3 and pre["signal"] == signal.SIGUSR1
    assert run.checkpoint_steps() == [2, 3]
    assert json.loads((run.checkpoint(2) / "trainer_state.json").read_text())["cursor"]["next_step"] == 3
    assert json.loads((run.checkpoint(3) / "trainer_state.json").read_text())["cursor"]["next_step"] == 4
    # No step skipped or trained twice; same data per step; same losses and weights as the
    # uninterrupted reference (bit for bit: same ops, same order, one process).
    assert [r["step"] for r in read_metrics(run.root, "trainer") if "loss" in r] == [1, 2, 3]
    for s in (1, 2, 3):
        assert [p.name for p in run.claimed_step(s).glob("*.h5")] == [dataset_shards(reference)[s - 1].name]
        assert losses(run)[s] == losses(reference)[s]
    got, want = weights(run, 3), weights(reference, 3)
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("train.tensor_parallel=2",), ("train.expert_parallel=2", "train.data_parallel=2")],
                         ids=["tp2_sp", "ep2_dp2"])
def test_parallel_layouts_match_tp1(tmp_path, dataset, reference, layout):
    """TP=2 (sequence parallel, experts replicated per TP rank) and EP=2 (two DP ranks, experts
    split) train to the TP=1 reference's losses.

    Tolerance: losses within 1e-5 relative.  Weights after two Adam steps: at most 0.1% of
    the elements differ by more than 1e-5, none by more than 2 * lr * steps.  Why not tighter:
    TP and DP sum gradients in another order (float32 rounding ~1e-7 relative), and Adam's
    first steps move every weight by about +-lr whatever the gradient's size, so a gradient
    that is ~0 up to rounding may flip the sign of its step.  A wrong reduction (e.g. expert
    grads not summed over TP ranks) moves a third of the expert weights by 2 * lr.
    """
    lr, steps = 0.002, 2
    run = new_run(tmp_path, dataset, "run", f"train.steps={steps}", *layout)
    add_shards(run, dataset, [1, 2])
    wait_ok(run, start(run, 2))
    got = losses(run)
    assert sorted(got) == [1, 2]
    for s in (1, 2):
        assert got[s] == pytest.approx(losses(reference)[s], rel=1e-5, abs=1e-7)
    # weights/v_2 of both runs: the same two updates from the same data
    a, b = weights(run, steps), weights(reference, steps)
    assert sorted(a) == sorted(b)
    off, total, worst = 0, 0, 0.0
    for k in b:
        d = np.abs(a[k].numpy() - b[k].numpy())
        off, total, worst = off + int((d > 1e-5).sum()), total + d.size, max(worst, float(d.max()))
    assert off / total < 1e-3, f"{off} of {total} weights differ by > 1e-5"
    assert worst <= 2 * lr * steps + 1e-6


@pytest.mark.slow
def test_publish_via_reshard_equals_direct_export(tmp_path, dataset, reference):
    # train.publish_via=reshard: checkpoint, then neon_hpc.reshard.convert of it -> weights/v_N.
    run = new_run(tmp_path, dataset, "run", "train.steps=2", "train.publish_via=reshard")
    add_shards(run, dataset, [1, 2])
    wait_ok(run, start(run))
    assert run.weight_versions() == [0, 1, 2] and run.latest_weights()[0] == 2
    assert run.checkpoint_steps() == [0, 1, 2]          # one checkpoint per published version
    for v in (0, 1, 2):
        got, want = weights(run, v), weights(reference, v)
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=f"v_{v} {k}")


@pytest.mark.slow
def test_two_ranks_checkpoint_every_step_beside_the_steps_and_resume_from_the_last(tmp_path, dataset, reference):
    """EP=2 x DP=2, a checkpoint after every step: from the third on, megatron's save runs on each
    rank's writer thread (its cached plan, no collective) and rank 0 seals beside the next step.
    Every checkpoint is complete, the run trains as the reference does, and a restart on two
    ranks resumes from step_4 with its digests and rank 0's parameter digest checked."""
    run = new_run(tmp_path, dataset, "run", "train.checkpoint_every=1", "train.expert_parallel=2",
                  "train.data_parallel=2")
    add_shards(run, dataset, range(1, STEPS + 1))
    wait_ok(run, start(run, 2))
    assert run.checkpoint_steps() == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):
        assert (run.checkpoint(s) / "integrity.json").is_file() and (run.checkpoint(s) / "rng" / "rank_1.pt").is_file()
    assert not [p for p in run.checkpoints.iterdir() if p.name.startswith(".")]
    got = losses(run)
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(losses(reference)[s], rel=1e-5, abs=1e-7)
    trainer_log = "\n".join(p.read_text() for p in sorted((run.root / "logs" / "trainer").glob("*.log")))
    assert "checkpoint step_4: snapshot" in trainer_log and "sealed in" in trainer_log
    before = set(run.root.glob("stdout.*.txt"))
    wait_ok(run, start(run, 2))                 # nothing left to train: it resumes and exits
    out = "\n".join(p.read_text() for p in set(run.root.glob("stdout.*.txt")) - before)
    assert "resumed from" in out and "step_4" in out, out[-2000:]
