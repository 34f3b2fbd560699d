"""Admission control of the rollout worker, against a real run directory: steps of data
ahead of the trainer plus the version gap between the trainer's next claim and the engines;
heartbeats of long groups stay fresh."""

from __future__ import annotations

import time

import pytest

from neon_hpc import config
from neon_hpc.protocol.rundir import RunDir, atomic_write_json
from neon_hpc.rollout import worker
from neon_hpc.rollout.sections import WorkerSections

TINY = "configs/tiny_cpu.yaml"


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "run").create()


def _publish(run: RunDir, version: int) -> None:
    run.weights_version(version).mkdir(parents=True, exist_ok=True)
    run.publish_latest(version)


def _engines_hold(run: RunDir, node: int, version: int) -> None:
    atomic_write_json(run.state / "engines" / f"node{node}.json", {"urls": ["http://x"], "version": version})


def test_version_gap_is_the_next_claims_version_minus_what_the_node_serves(run):
    assert worker.version_gap(run, 0) == 0                  # nothing published, no trainer yet
    _publish(run, 5)
    assert worker.version_gap(run, 0) == 0                  # engines started elsewhere count as serving LATEST
    _engines_hold(run, 0, 3)
    _engines_hold(run, 1, 5)
    assert worker.version_gap(run, 0) == 2                  # no trainer heartbeat: LATEST - served
    assert worker.version_gap(run, 1) == 0
    # step 6 is claiming: its claim trains v_5
    run.beat("trainer", 0, step=6, version=5, phase="claiming")
    assert worker.version_gap(run, 1) == 0
    # step 6 has its data and trains: the next claim (step 7) trains v_6, one past LATEST
    run.beat("trainer", 0, step=6, version=5, phase="training")
    assert (worker.version_gap(run, 0), worker.version_gap(run, 1)) == (3, 1)
    run.beat("trainer", 0, step=6, version=6, phase="stepped")
    assert worker.version_gap(run, 1) == 1
    _engines_hold(run, 0, 9)                                 # never negative
    assert worker.version_gap(run, 0) == 0


def test_admission_adds_the_lag_to_the_steps_ahead(run):
    cfg = WorkerSections.of(config.load(TINY, ["train.trajectories_per_step=8", "rollout.group_size=4",
                                               "offpolicy.max_staleness=2"]))
    # 12 trajectories in flight elsewhere: this group is the 16th -> consumed 1 step after the next
    run.beat("rollout", 7, in_flight=12)
    assert worker.admission(run, cfg, 4, lag=0) == ("ok", 1.0)
    assert worker.admission(run, cfg, 4, lag=1) == ("ok", 2.0)
    assert worker.admission(run, cfg, 4, lag=2) == ("admission_wait", 3.0)


def test_a_stale_heartbeat_stops_counting_and_the_beater_keeps_it_fresh(run, monkeypatch):
    cfg = WorkerSections.of(config.load(TINY, ["train.trajectories_per_step=8", "rollout.group_size=4",
                                               "offpolicy.max_staleness=0"]))
    run.beat("rollout", 3, in_flight=8)
    assert worker.admission(run, cfg, 4)[0] == "admission_wait"
    hb = run.heartbeat_file("rollout", 3)
    atomic_write_json(hb, {"role": "rollout", "rank": 3, "time": time.time() - 61, "in_flight": 8})
    assert worker.admission(run, cfg, 4)[0] == "ok"          # a worker silent for a minute is presumed dead

    monkeypatch.setattr(worker, "HEARTBEAT_S", 0.05)
    beater = worker._Beater(run, 3)
    try:
        beater.beat(in_flight=8, groups=1)
        atomic_write_json(hb, {"role": "rollout", "rank": 3, "time": time.time() - 61, "in_flight": 8})
        deadline = time.monotonic() + 5
        while worker.admission(run, cfg, 4)[0] == "ok" and time.monotonic() < deadline:
            time.sleep(0.05)
        # the thread re-beat while the "group" ran: its trajectories count again
        assert worker.admission(run, cfg, 4)[0] == "admission_wait"
    finally:
        beater.close()


def test_wake_key_moves_with_the_trainers_claim_and_the_engines_load(run):
    run.beat("trainer", 0, step=3, version=2, phase="claiming")
    _engines_hold(run, 0, 2)
    k0 = worker.wake_key(run, 0)
    run.beat("rollout", 5, in_flight=4)          # other workers' beats do not wake a refused worker
    assert worker.wake_key(run, 0) == k0
    run.beat("trainer", 0, step=3, version=2, phase="training")
    k1 = worker.wake_key(run, 0)
    assert k1 != k0
    _engines_hold(run, 0, 3)
    assert worker.wake_key(run, 0) != k1
