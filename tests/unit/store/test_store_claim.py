"""claim_step semantics: whole shards, FIFO, committed claims replay, half-claims roll forward,
timeouts name the directory, stale trajectories are dropped and recorded."""

import json
import os
import threading
import time
import zlib

import numpy as np
import pytest

from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.rundir import RunDir, atomic_write_json
from neon_hpc.store import (
    ClaimConflict,
    ClaimTimeout,
    ShardWriter,
    claim_step,
    claimed_steps,
    ready_count,
    staleness_stats,
)
from neon_hpc.store.claim import CLAIM_FILE, DROPPED_FILE, OWNER_FILE
from neon_hpc.store.synthetic import make_trajectory
from neon_hpc.train.offpolicy import StalePolicy

CFG = StoreConfig(fsync=False)


def _publish(run, tag, n_traj, version=0, span=1, tokens=20):
    # a seed from the tag that is the same in every process (str hash() is salted per process:
    # a draw whose model turns came out empty once left a trajectory with no version to judge)
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    with ShardWriter(run, f"w-{tag}", CFG) as w:
        for i in range(n_traj):
            w.add(make_trajectory(rng, tokens, version=version, versions_span=span, task_id=f"{tag}-{i}"))
    return w.published[0].path


def _ids(res):
    return [t.task_id for t in res.trajectories]


def test_claims_whole_shards_oldest_first_until_enough(tmp_path):
    for k, n in enumerate([2, 3, 2, 4]):
        _publish(tmp_path, f"s{k}", n)
        time.sleep(0.002)  # distinct creation milliseconds, so FIFO order is defined
    res = claim_step(tmp_path, 0, want=4, consumer="trainer-0", timeout_s=0)
    assert _ids(res) == ["s0-0", "s0-1", "s1-0", "s1-1", "s1-2"]   # 5 >= 4: shards are never split
    assert len(res.shards) == 2 and all(p.parent.name == "step_0" for p in res.shards)
    assert ready_count(tmp_path) == (2, 6)
    assert claimed_steps(tmp_path) == [0]
    rec = json.loads((RunDir(tmp_path).claimed_step(0) / CLAIM_FILE).read_text())
    assert rec["trajectories"] == 5 and rec["consumer"] == "trainer-0" and rec["want"] == 4


def test_committed_claim_returns_the_same_trajectories_again(tmp_path):
    _publish(tmp_path, "a", 3)
    first = claim_step(tmp_path, 7, want=3, consumer="trainer-0", timeout_s=0)
    _publish(tmp_path, "b", 3)   # new data must not leak into a replayed step
    again = claim_step(tmp_path, 7, want=3, consumer="trainer-0", timeout_s=0)
    assert again.resumed and not first.resumed
    assert _ids(again) == _ids(first)
    assert all(a.same_as(b) for a, b in zip(first.trajectories, again.trajectories))
    assert ready_count(tmp_path) == (1, 3)


def test_half_made_claim_is_rolled_forward_without_loss_or_duplicates(tmp_path):
    rd = RunDir(tmp_path)
    for k in range(3):
        _publish(tmp_path, f"h{k}", 2)
        time.sleep(0.002)
    # what a consumer killed mid-claim leaves: its owner record and one shard moved in, no CLAIM.json
    step_dir = rd.claimed_step(3)
    step_dir.mkdir(parents=True)
    atomic_write_json(step_dir / OWNER_FILE, {"consumer": "trainer-0", "pid": 1, "host": "dead"})
    first = sorted(os.listdir(rd.traj_ready))[0]
    os.rename(rd.traj_ready / first, step_dir / first)

    res = claim_step(tmp_path, 3, want=4, consumer="trainer-0", timeout_s=0)
    assert sorted(_ids(res)) == ["h0-0", "h0-1", "h1-0", "h1-1"]
    assert (step_dir / CLAIM_FILE).exists()
    assert ready_count(tmp_path) == (1, 2)


def test_half_made_claim_of_another_consumer_is_refused(tmp_path):
    rd = RunDir(tmp_path)
    _publish(tmp_path, "c", 2)
    rd.claimed_step(1).mkdir(parents=True)
    atomic_write_json(rd.claimed_step(1) / OWNER_FILE, {"consumer": "trainer-9", "pid": 1, "host": "h"})
    with pytest.raises(ClaimConflict, match="trainer-9") as ei:
        claim_step(tmp_path, 1, want=1, consumer="trainer-0", timeout_s=0)
    assert str(rd.claimed_step(1)) in str(ei.value)
    assert ready_count(tmp_path) == (1, 2)


def test_timeout_names_the_directory_and_leaves_no_empty_claim(tmp_path):
    RunDir(tmp_path).create()
    with pytest.raises(ClaimTimeout) as ei:
        claim_step(tmp_path, 0, want=1, consumer="trainer-0", timeout_s=0.2, poll_s=0.05)
    assert isinstance(ei.value, TimeoutError)
    assert str(RunDir(tmp_path).traj_ready) in str(ei.value)
    assert not RunDir(tmp_path).claimed_step(0).exists()


def test_timeout_with_too_little_keeps_the_half_claim_for_the_retry(tmp_path):
    _publish(tmp_path, "p", 2)
    with pytest.raises(ClaimTimeout, match="only 2 of 5"):
        claim_step(tmp_path, 0, want=5, consumer="trainer-0", timeout_s=0.1, poll_s=0.05)
    _publish(tmp_path, "q", 3)
    res = claim_step(tmp_path, 0, want=5, consumer="trainer-0", timeout_s=0)
    assert sorted(_ids(res)) == ["p-0", "p-1", "q-0", "q-1", "q-2"]


def test_allow_partial_commits_what_arrived(tmp_path):
    _publish(tmp_path, "r", 2)
    res = claim_step(tmp_path, 0, want=10, consumer="trainer-0", timeout_s=0.1, poll_s=0.05, allow_partial=True)
    assert sorted(_ids(res)) == ["r-0", "r-1"] and claimed_steps(tmp_path) == [0]


def test_blocks_until_a_writer_publishes(tmp_path):
    rd = RunDir(tmp_path).create()
    results = []
    t = threading.Thread(target=lambda: results.append(
        claim_step(tmp_path, 0, want=2, consumer="trainer-0", timeout_s=60, poll_s=0.05)))
    t.start()
    while not rd.claimed_step(0).exists():   # the claim has started and found ready/ empty ...
        time.sleep(0.01)
    time.sleep(0.2)
    _publish(tmp_path, "late", 2)            # ... and only now does a writer publish
    t.join()
    assert _ids(results[0]) == ["late-0", "late-1"] and results[0].waited_s > 0


def test_stale_trajectories_are_dropped_counted_and_recorded(tmp_path):
    _publish(tmp_path, "old", 2, version=1)          # staleness 4 at trainer v5
    _publish(tmp_path, "ok", 3, version=4, span=2)   # versions 4..5: staleness <= 1
    # the consumer's admission rule (the trainer's stale policy) decides what is kept; the store records it
    res = claim_step(tmp_path, 0, want=3, consumer="trainer-0", admit=StalePolicy(5, 2, "drop"), timeout_s=0)
    assert sorted(_ids(res)) == ["ok-0", "ok-1", "ok-2"] and res.dropped_stale == 2
    rec = json.loads((RunDir(tmp_path).claimed_step(0) / DROPPED_FILE).read_text())
    assert sorted(d["task_id"] for d in rec["dropped"]) == ["old-0", "old-1"]
    assert {d["staleness"] for d in rec["dropped"]} == {4}
    again = claim_step(tmp_path, 0, want=3, consumer="trainer-0", admit=StalePolicy(9, 0, "drop"), timeout_s=0)
    assert sorted(_ids(again)) == sorted(_ids(res)) and again.dropped_stale == 2   # replay, not re-filter
    stats = staleness_stats(res.trajectories, 5)
    assert stats["staleness_max"] <= 1 and sum(stats["staleness_hist"].values()) == 3


def test_concurrent_threads_on_different_steps_never_share_a_shard(tmp_path):
    for k in range(12):
        _publish(tmp_path, f"x{k}", 1)
    results = {}

    def consume(step):
        results[step] = claim_step(tmp_path, step, want=3, consumer=f"c{step}", timeout_s=5, poll_s=0.01)

    threads = [threading.Thread(target=consume, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ids = [i for r in results.values() for i in _ids(r)]
    assert sorted(ids) == sorted(f"x{k}-0" for k in range(12))
