"""The TrajectoryStore contract (neon_hpc/store/base.py): what every store implementation must
do, run against each registered kind (``STORES``) with real trajectories.  A new store passes
this module unchanged; its kind is picked up from the registry."""

import time

import numpy as np
import pytest

from neon_hpc import config
from neon_hpc.config import ConfigError
from neon_hpc.config.store import StoreKind
from neon_hpc.store import STORES, ClaimTimeout, StoreConfig, TrajectoryStore, open_store
from neon_hpc.store.synthetic import make_trajectory


@pytest.fixture(params=sorted(STORES))
def store(request, tmp_path) -> TrajectoryStore:
    return open_store(tmp_path / "run", StoreConfig(kind=request.param, fsync=False, flush_trajectories=1000))


def _publish(store, tag, n, version=0, tokens=24):
    """One writer publishes ``n`` trajectories as one batch; returns them as written."""
    rng = np.random.default_rng(sum(map(ord, tag)))
    trajs = [make_trajectory(rng, tokens, version=version, task_id=f"{tag}-{i}", group_id=tag) for i in range(n)]
    with store.writer(f"w-{tag}") as w:
        for t in trajs:
            w.add(t)
    time.sleep(0.002)   # distinct publish milliseconds: publish order is claim order
    return trajs


def _ids(trajs):
    return [t.task_id for t in trajs]


def test_the_config_kinds_are_the_registered_stores():
    assert set(StoreKind.__args__) == set(STORES)
    assert StoreConfig().kind == "filesystem"


def test_an_unknown_kind_is_refused_naming_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match="store.kind.*'s3'.*filesystem"):
        open_store(tmp_path, StoreConfig(kind="s3"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  kind: s3\n")
    with pytest.raises(ConfigError, match="store.kind"):
        config.load(bad)


def test_published_trajectories_are_counted_ready(store):
    assert store.ready_count() == (0, 0)
    _publish(store, "a", 3)
    _publish(store, "b", 2)
    assert store.ready_count() == (2, 5)
    c = store.counts()
    assert (c.ready, c.claimed, c.quarantined, c.writing) == (2, 0, 0, 0)


def test_a_claim_hands_out_what_was_written_exactly_once(store):
    a = _publish(store, "a", 3)
    b = _publish(store, "b", 3)
    first = store.claim(1, want=3, consumer="trainer-0", timeout_s=0)
    second = store.claim(2, want=3, consumer="trainer-0", timeout_s=0)
    assert _ids(first.trajectories) == _ids(a) and _ids(second.trajectories) == _ids(b)
    for got, want in zip(first.trajectories, a):   # the payload survives the store bit for bit
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
        assert got.rewards == want.rewards and got.metadata == want.metadata
    assert store.ready_count() == (0, 0)
    assert store.counts().claimed == 2


def test_a_committed_step_returns_the_same_trajectories_again(store):
    _publish(store, "a", 2)
    first = store.claim(4, want=2, consumer="trainer-0", timeout_s=0)
    _publish(store, "b", 2)    # new data must not leak into a replayed step
    again = store.claim(4, want=2, consumer="trainer-0", timeout_s=0)
    assert again.resumed and _ids(again.trajectories) == _ids(first.trajectories)
    assert store.ready_count() == (1, 2)


def test_a_claim_without_enough_data_times_out_and_takes_nothing(store):
    _publish(store, "a", 1)
    with pytest.raises(ClaimTimeout, match="1 of 5"):
        store.claim(0, want=5, consumer="trainer-0", timeout_s=0, poll_s=0.01)
    assert store.claimed_steps() == []


def test_claimed_steps_are_the_committed_ones_ascending(store):
    for tag in "abc":
        _publish(store, tag, 2)
    for step in (5, 2, 9):
        store.claim(step, want=2, consumer="trainer-0", timeout_s=0)
    assert store.claimed_steps() == [2, 5, 9]


def test_iter_trained_yields_each_steps_trajectories_in_step_order(store):
    written = {tag: _publish(store, tag, 2) for tag in "abc"}
    for step in (3, 1, 2):   # claims take the oldest published first: step 3 gets a, 1 gets b, 2 gets c
        store.claim(step, want=2, consumer="trainer-0", timeout_s=0)
    got = list(store.iter_trained())
    assert [s for s, _ in got] == [1, 1, 2, 2, 3, 3]
    assert _ids(t for _, t in got) == _ids(written["b"] + written["c"] + written["a"])
    assert [s for s, _ in store.iter_trained(steps=2)] == [1, 1, 2, 2]
    np.testing.assert_array_equal(got[0][1].tokens, written["b"][0].tokens)


def test_sweep_staging_keeps_published_and_claimed_data(store):
    _publish(store, "a", 2)
    _publish(store, "b", 2)
    store.claim(0, want=2, consumer="trainer-0", timeout_s=0)
    assert store.sweep_staging() >= 0
    assert store.ready_count() == (1, 2) and store.claimed_steps() == [0]
    assert len(list(store.iter_trained())) == 2


def test_a_fixed_set_reads_back_as_written_in_a_stable_order(store, tmp_path):
    """Demonstrations and SFT data go through the store's fixed sets (``write_set`` / ``read_set``)."""
    rng = np.random.default_rng(7)
    trajs = [make_trajectory(rng, 24, task_id=f"d-{i}", group_id="d") for i in range(5)]
    kind = type(store)
    parts = kind.write_set(tmp_path / "set", trajs, "demos", per_shard=2)
    assert len(parts) == 3 and all(p.exists() for p in parts)
    back = kind.read_set(tmp_path / "set")
    assert _ids(back) == _ids(trajs) and all(a.same_as(b) for a, b in zip(back, trajs))
    assert kind.read_set(tmp_path / "nothing-here") == []
