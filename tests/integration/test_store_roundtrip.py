"""Shards round-trip ragged trajectories byte-exactly; the writer publishes only complete files."""

import math
import os
import shutil
import subprocess
import time

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from neon_hpc.config.store import StoreConfig
from neon_hpc.store import ShardWriter, Trajectory, read_shard, ready_count, schema as S, shard_summary
from neon_hpc.store.synthetic import make_trajectory
from neon_hpc.store.writer import tmp_name


def _ragged(rng, lengths, **kw):
    return [make_trajectory(rng, n, task_id=f"t{i}", group_id=f"g{i // 2}", **kw) for i, n in enumerate(lengths)]


def _write(tmp_path, trajs, cfg=StoreConfig(fsync=False)):
    with ShardWriter(tmp_path, "rollout-0", cfg) as w:
        for t in trajs:
            w.add(t)
    assert len(w.published) == 1
    return w.published[0].path


def _assert_same(a_list, b_list):
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        assert a.same_as(b), (a, b)


LENGTHS = [1, 0, 37, 513, 2, 4096, 9]


def test_ragged_roundtrip_with_routes_is_byte_exact(tmp_path):
    rng = np.random.default_rng(1)
    trajs = _ragged(rng, LENGTHS, moe_layers=3, top_k=4, num_experts=384)
    out = read_shard(_write(tmp_path, trajs))
    _assert_same(trajs, out)
    assert out[3].routed_experts.dtype == np.uint16 and out[3].routed_experts.shape == (513, 3, 4)


def test_ragged_roundtrip_without_routes(tmp_path):
    rng = np.random.default_rng(2)
    trajs = _ragged(rng, LENGTHS, routes=False)
    p = _write(tmp_path, trajs)
    with h5py.File(p) as f:
        assert S.ROUTES not in f and S.ROUTE_OFFSETS not in f
    out = read_shard(p)
    _assert_same(trajs, out)
    assert all(t.routed_experts is None for t in out)


def test_mixed_presence_of_routes_and_empty_route_arrays_survive(tmp_path):
    rng = np.random.default_rng(3)
    trajs = _ragged(rng, [10, 0, 5, 0], num_experts=8)
    trajs[2].routed_experts = None           # one without routes
    trajs[3].routed_experts = None           # an empty one without routes ...
    # ... while trajs[1] is empty *with* routes (shape (0, L, K)): the two must stay distinct
    out = read_shard(_write(tmp_path, trajs))
    _assert_same(trajs, out)
    assert out[1].routed_experts is not None and out[1].routed_experts.shape == (0, 2, 2)
    assert out[3].routed_experts is None


def test_a_shard_of_one_empty_trajectory_with_routes(tmp_path):
    t = make_trajectory(np.random.default_rng(0), 0, moe_layers=61, top_k=8, num_experts=384)
    (out,) = read_shard(_write(tmp_path, [t]))
    assert out.same_as(t) and out.routed_experts.shape == (0, 61, 8)


def test_int32_routes_stored_compactly_and_returned_as_int32(tmp_path):
    rng = np.random.default_rng(4)
    trajs = _ragged(rng, [300, 200], num_experts=200, routes_dtype=np.int32)
    p = _write(tmp_path, trajs)
    with h5py.File(p) as f:
        assert f[S.ROUTES].dtype == np.uint8          # 200 experts fit a byte on disk
    out = read_shard(p)
    _assert_same(trajs, out)
    assert out[0].routed_experts.dtype == np.int32


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compressed_routes_roundtrip(tmp_path, compression):
    rng = np.random.default_rng(5)
    trajs = _ragged(rng, [700, 0, 3000], num_experts=64)
    cfg = StoreConfig(fsync=False, routed_experts_compression=compression, compression_chunk_tokens=512)
    p = _write(tmp_path, trajs, cfg)
    with h5py.File(p) as f:
        assert f[S.ROUTES].compression == compression and f[S.ROUTES].chunks[0] == 512
    _assert_same(trajs, read_shard(p))


def test_scalar_fields_and_json_survive(tmp_path):
    t = Trajectory(tokens=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -0.5, -1.25], versions=[-1, 3, 4],
                   reward=-1.5, rewards={"success": 0.0, "dense": -1.5}, task_id="xrd/Ä-001", group_id="grp",
                   turn_offsets=[0, 1, 3], advantage=0.25, metadata={"elements": ["Fe", "O"], "n": 2},
                   timings={"episode_s": 12.5})
    (out,) = read_shard(_write(tmp_path, [t]))
    assert out.tokens.dtype == np.int32 and out.tokens.tolist() == [5, 6, 7]
    assert out.reward == -1.5 and out.advantage == 0.25 and out.task_id == "xrd/Ä-001"
    assert out.metadata == {"elements": ["Fe", "O"], "n": 2} and out.timings == {"episode_s": 12.5}
    assert out.version_range() == (3, 4) and out.turns().tolist() == [0, 1, 3]
    fresh = make_trajectory(np.random.default_rng(0), 4)
    (back,) = read_shard(_write(tmp_path / "b", [fresh]))
    assert math.isnan(back.advantage)


def test_file_attributes_name_writer_job_and_schema(tmp_path):
    rng = np.random.default_rng(6)
    with ShardWriter(tmp_path, "rollout.7/x", StoreConfig(fsync=False), job_id="4242") as w:
        for t in _ragged(rng, [4, 5]):
            w.add(t)
    p = w.published[0].path
    s = shard_summary(p)["attrs"]
    assert s["schema_version"] == S.SCHEMA_VERSION and s["format"] == S.FORMAT
    assert s["writer_id"] == "rollout.7/x" and s["job_id"] == "4242"
    assert s["num_trajectories"] == 2 and s["num_tokens"] == 9 and s["checksum"].startswith(S.CHECKSUM_ALGO)
    assert abs(s["created"] - time.time()) < 3600
    name = S.parse_shard_name(p.name)
    assert name.writer == "rollout-7-x" and name.num_trajectories == 2


def test_writer_flushes_by_count_and_publishes_into_ready(tmp_path):
    rng = np.random.default_rng(7)
    w = ShardWriter(tmp_path, "rollout-1", StoreConfig(flush_trajectories=3, fsync=False))
    paths = [w.add(t) for t in _ragged(rng, [3] * 7)]
    assert [p is not None for p in paths] == [False, False, True, False, False, True, False]
    assert ready_count(tmp_path) == (2, 6)
    w.close()
    assert ready_count(tmp_path) == (3, 7)
    assert os.listdir(tmp_path / "trajectories" / "tmp") == []
    names = sorted(os.listdir(tmp_path / "trajectories" / "ready"))
    assert [S.parse_shard_name(n).seq for n in names] == [0, 1, 2]


def test_writer_flushes_by_age_and_by_bytes(tmp_path):
    rng = np.random.default_rng(8)
    w = ShardWriter(tmp_path, "r", StoreConfig(flush_trajectories=100, flush_seconds=0.05, fsync=False))
    assert w.add(make_trajectory(rng, 4)) is None
    time.sleep(0.06)
    w.flush_if_due()
    assert ready_count(tmp_path) == (1, 1) and w.pending == 0
    w2 = ShardWriter(tmp_path, "s", StoreConfig(flush_trajectories=100, flush_bytes=10_000, fsync=False))
    assert w2.add(make_trajectory(rng, 100, moe_layers=1, top_k=1)) is None   # ~1.5 KB
    assert w2.add(make_trajectory(rng, 1000, moe_layers=1, top_k=1)) is not None  # ~15 KB: over


def test_writer_rejects_bad_trajectories_at_add(tmp_path):
    rng = np.random.default_rng(9)
    w = ShardWriter(tmp_path, "r", StoreConfig(fsync=False))
    t = make_trajectory(rng, 5)
    t.logprobs = t.logprobs[:4]
    with pytest.raises(ValueError, match="logprobs has shape"):
        w.add(t)
    t = make_trajectory(rng, 5)
    t.tokens = np.array([1, 2, 3, 4, 2**40])
    with pytest.raises(ValueError, match="out of range for int32"):
        w.add(t)
    t = make_trajectory(rng, 5)
    t.metadata = {"x": object()}
    with pytest.raises(ValueError, match="metadata is not JSON"):
        w.add(t)
    t = make_trajectory(rng, 5)
    t.turn_offsets = np.array([0, 9])
    with pytest.raises(ValueError, match="turn_offsets"):
        w.add(t)
    w.add(make_trajectory(rng, 5, moe_layers=2))
    with pytest.raises(ValueError, match="routed_experts differ"):
        w.add(make_trajectory(rng, 5, moe_layers=3))
    assert w.pending == 1


def test_restarted_writer_removes_its_predecessors_and_stale_tmp_files_only(tmp_path):
    rng = np.random.default_rng(10)
    ShardWriter(tmp_path, "rollout-2", StoreConfig(fsync=False))
    tmp = tmp_path / "trajectories" / "tmp"
    mine = tmp / tmp_name(str(S.ShardName(1, "rollout-2", "deadbeef", 0, 1)))
    other = tmp / tmp_name(str(S.ShardName(1, "rollout-3", "deadbeef", 0, 1)))
    dead = tmp / tmp_name(str(S.ShardName(1, "rollout-9", "0badcafe", 0, 1)))
    mine.write_bytes(b"torn")
    other.write_bytes(b"in progress")
    dead.write_bytes(b"torn long ago")
    os.utime(dead, (time.time() - 7200, time.time() - 7200))
    w = ShardWriter(tmp_path, "rollout-2", StoreConfig(fsync=False, stale_tmp_s=3600))
    assert not mine.exists() and other.exists() and not dead.exists()
    w.add(make_trajectory(rng, 3))
    w.close()
    assert ready_count(tmp_path) == (1, 1)


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (hdf5-tools) is not installed")
def test_h5dump_reads_a_shard_without_plugins(tmp_path):
    rng = np.random.default_rng(11)
    p = _write(tmp_path, _ragged(rng, [3, 4], num_experts=8),
               StoreConfig(fsync=False, routed_experts_compression="gzip"))
    out = subprocess.run(["h5dump", "-d", "offsets", "-d", "routed_experts", str(p)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "(0): 0, 3, 7" in out.stdout and "H5T_STD_U16LE" in out.stdout


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 60), min_size=1, max_size=8),
       routes=st.lists(st.booleans(), min_size=8, max_size=8),
       layers=st.integers(1, 3), top_k=st.integers(1, 4), experts=st.sampled_from([2, 256, 300, 70_000]),
       seed=st.integers(0, 2**16))
def test_any_ragged_mix_roundtrips_byte_exactly(tmp_path_factory, lengths, routes, layers, top_k, experts, seed):
    rng = np.random.default_rng(seed)
    dt = np.uint32 if experts > 65535 else np.uint16
    trajs = [make_trajectory(rng, n, moe_layers=layers, top_k=top_k, num_experts=experts, routes=routes[i],
                             routes_dtype=dt, task_id=f"t{i}") for i, n in enumerate(lengths)]
    out = read_shard(_write(tmp_path_factory.mktemp("h"), trajs))
    _assert_same(trajs, out)
