"""The claim's read-ahead (``store/readahead.py``): the next claim's shards are read beside the
step and the claim takes them from memory, with the same outcome as reading them itself; a shard
replaced, invalid or taken by someone else is read (or skipped) as before.  Real HDF5 shards."""

from __future__ import annotations

import shutil
import time
import zlib

import numpy as np

from neon_hpc.config.store import StoreConfig
from neon_hpc.store import ShardWriter, claim_step, open_store
from neon_hpc.store.synthetic import make_trajectory

CFG = StoreConfig(fsync=False)


def _publish(run, tag, n_traj, tokens=20):
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    with ShardWriter(run, f"w-{tag}", CFG) as w:
        for i in range(n_traj):
            w.add(make_trajectory(rng, tokens, task_id=f"{tag}-{i}"))
    time.sleep(0.002)             # distinct creation milliseconds: a defined FIFO order
    return w.published[0].path


def _held(store, n, timeout_s=60.0):
    t0 = time.monotonic()
    while len(store._ahead._held) < n:
        assert time.monotonic() - t0 < timeout_s, f"read-ahead holds {len(store._ahead._held)} of {n} shards"
        time.sleep(0.01)
    store._ahead._thread.join(timeout_s)     # it stops once the next claim's share is held


def _tokens(res):
    return [(t.task_id, t.tokens.tolist(), t.logprobs.tolist()) for t in res.trajectories]


def test_the_claim_takes_the_shards_read_ahead_and_gets_what_a_plain_claim_gets(tmp_path):
    plain_dir, ahead_dir = tmp_path / "plain", tmp_path / "ahead"
    for d in (plain_dir, ahead_dir):
        for k in range(4):
            _publish(d, f"s{k}", 2)
    store = open_store(ahead_dir, CFG)
    store.read_ahead(4)                       # the next claim wants 4: the two oldest shards
    _held(store, 2)
    assert sorted(store._ahead._held) == sorted(p.name for p in sorted((ahead_dir / "trajectories" / "ready")
                                                                        .iterdir()))[:2]
    got = store.claim(1, want=4, consumer="trainer-0", timeout_s=0)
    want = claim_step(plain_dir, 1, want=4, consumer="trainer-0", timeout_s=0)
    assert _tokens(got) == _tokens(want) and len(got.shards) == 2
    assert (store._ahead.hits, store._ahead.misses) == (2, 0) == store.read_ahead_counts()
    again = store.claim(1, want=4, consumer="trainer-0", timeout_s=0)   # another rank's read-back: from disk
    assert _tokens(again) == _tokens(want) and store.read_ahead_counts() == (2, 2)
    store.close()


def test_a_shard_replaced_after_it_was_read_is_read_again(tmp_path):
    first = _publish(tmp_path, "a", 2)
    store = open_store(tmp_path, CFG)
    store.read_ahead(2)
    _held(store, 1)
    copy = first.with_name(".copy")
    shutil.copyfile(first, copy)
    copy.replace(first)                                   # the same name and bytes, another file
    res = store.claim(1, want=2, consumer="trainer-0", timeout_s=0)
    assert [t.task_id for t in res.trajectories] == ["a-0", "a-1"]
    assert (store._ahead.hits, store._ahead.misses) == (0, 1)


def test_an_invalid_shard_is_not_held_and_the_claim_quarantines_it_as_before(tmp_path):
    bad = _publish(tmp_path, "bad", 2)
    good = _publish(tmp_path, "good", 2)
    bad.write_bytes(bad.read_bytes()[:2000])               # torn: its first 2000 bytes
    store = open_store(tmp_path, CFG)
    store.read_ahead(4)
    _held(store, 1)
    assert list(store._ahead._held) == [good.name]
    res = store.claim(1, want=2, consumer="trainer-0", timeout_s=0)
    assert [p.name for p in res.quarantined] == [bad.name] and [t.task_id for t in res.trajectories] == ["good-0",
                                                                                                          "good-1"]
    assert store._ahead.hits == 1


def test_a_held_shard_taken_by_another_consumer_is_forgotten_and_a_new_one_is_read(tmp_path):
    _publish(tmp_path, "a", 2)
    store = open_store(tmp_path, CFG)
    store.read_ahead(2)
    _held(store, 1)
    claim_step(tmp_path, 1, want=2, consumer="someone-else", timeout_s=0)   # not through this store
    _publish(tmp_path, "b", 2)
    store.read_ahead(2)
    _held(store, 1)
    assert len(store._ahead._held) == 1          # only b: a left ready/ through the other claim
    res = store.claim(2, want=2, consumer="someone-else", timeout_s=0)
    assert [t.task_id for t in res.trajectories] == ["b-0", "b-1"] and store._ahead.hits == 1


def test_read_ahead_off_reads_as_before(tmp_path):
    _publish(tmp_path, "a", 2)
    store = open_store(tmp_path, StoreConfig(fsync=False, read_ahead=False))
    store.read_ahead(2)
    assert store._ahead is None
    assert len(store.claim(1, want=2, consumer="trainer-0", timeout_s=0).trajectories) == 2
