"""Corrupt shards are refused with a reason that names the fault, quarantined, and the run goes on."""

import dataclasses
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from neon_hpc.config.store import StoreConfig
from neon_hpc.store import ShardError, ShardWriter, claim_step, read_shard, ready_count, schema as S
from neon_hpc.store.claim import REASON_SUFFIX
from neon_hpc.store.synthetic import make_trajectory


def _good_shard(run, seed, n_traj=2, writer="w", legacy=True):
    """A published shard; ``legacy``: renamed without its file digest (the name's ``.x<digest>``),
    as shards written before it were, so the reader's own checks are what meets the damage."""
    rng = np.random.default_rng(seed)
    with ShardWriter(run, f"{writer}{seed}", StoreConfig(fsync=False)) as w:
        for i in range(n_traj):
            w.add(make_trajectory(rng, 50 + 10 * i, num_experts=16, task_id=f"{writer}{seed}-{i}"))
    p = w.published[0].path
    if not legacy:
        return p
    sn = S.parse_shard_name(p.name)
    assert sn.file_digest is not None                  # the writer names what it wrote
    return p.rename(p.with_name(str(dataclasses.replace(sn, file_digest=None))))


def _flip_byte_in(path, dataset, rel=0.5):
    with h5py.File(path) as f:
        d = f[dataset]
        at = d.id.get_offset() + int(d.id.get_storage_size() * rel)
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x40]))


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _set_schema_version(path, v):
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = v


def _break_offsets_keep_checksums(path):
    """Offsets that point past the tokens, with checksums recomputed so only the range check can catch it."""
    with h5py.File(path, "r+") as f:
        o = f[S.OFFSETS][()]
        o[1] = o[-1] + 5
        f[S.OFFSETS][...] = o
        per = S.decode_digests(f.attrs[S.DIGESTS_ATTR])
        per[S.OFFSETS] = S.array_digest(o)
        f.attrs[S.DIGESTS_ATTR] = S.encode_digests(per)
        f.attrs["checksum"] = S.file_checksum(per)


def _break_superblock(path):
    with open(path, "r+b") as fh:
        fh.write(b"\x00\x00\x00\x00")


CORRUPTIONS = {
    "truncated": (_truncate, "truncated"),
    "flipped_routes": (lambda p: _flip_byte_in(p, S.ROUTES), "checksum mismatch in dataset 'routed_experts'"),
    "flipped_tokens": (lambda p: _flip_byte_in(p, "tokens", 0.1), "checksum mismatch in dataset 'tokens'"),
    "schema_version": (lambda p: _set_schema_version(p, 99), "schema_version 99"),
    "offsets_out_of_range": (_break_offsets_keep_checksums, "offsets are out of range"),
    "superblock": (_break_superblock, "unreadable as HDF5"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_read_shard_names_the_file_and_the_fault(tmp_path, kind):
    p = _good_shard(tmp_path, 1)
    read_shard(p)  # valid before
    damage, words = CORRUPTIONS[kind]
    damage(p)
    with pytest.raises(ShardError) as ei:
        read_shard(p)
    assert words in ei.value.reason
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_shard_named_with_its_digest_is_refused_before_hdf5_opens_it(tmp_path, kind, monkeypatch):
    p = _good_shard(tmp_path, 1, legacy=False)
    read_shard(p)
    CORRUPTIONS[kind][0](p)

    def never(*a, **k):
        raise AssertionError("h5py opened a shard whose digest does not match")

    monkeypatch.setattr("neon_hpc.store.reader.h5py.File", never)
    with pytest.raises(ShardError, match="file digest mismatch .*it is not opened") as ei:
        read_shard(p)
    assert str(p) in str(ei.value)


SWEEP = r"""
import sys
from pathlib import Path
from neon_hpc.store import ShardError, read_shard
p = Path(sys.argv[1])
raw, caught = p.read_bytes(), 0
for i in range(len(raw)):
    b = bytearray(raw)
    b[i] ^= 0xFF
    p.write_bytes(bytes(b))
    try:
        read_shard(p)
    except ShardError as e:
        caught += "file digest mismatch" in e.reason
p.write_bytes(raw)
print(len(raw), caught, len(read_shard(p)))
"""


def test_every_single_byte_flip_of_a_digest_named_shard_is_refused_and_none_crashes(tmp_path):
    # unchecked, one flipped byte of the HDF5 header (offset ~2000 of such a shard) made libhdf5
    # crash the process (SIGSEGV): a trainer that claimed it died, and died again on resume
    p = _good_shard(tmp_path, 1, legacy=False)
    r = subprocess.run([sys.executable, "-c", SWEEP, str(p)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    size, caught, kept = map(int, r.stdout.split())
    assert caught == size and kept == 2


def test_missing_file_is_not_a_shard_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_shard(tmp_path / "nope.h5")


def test_claim_quarantines_every_corrupt_shard_and_consumes_the_good_ones(tmp_path):
    bad = {}  # written first, so the FIFO claim meets them before the good ones
    for i, kind in enumerate(sorted(CORRUPTIONS)):
        p = _good_shard(tmp_path, 100 + i, writer="bad")
        CORRUPTIONS[kind][0](p)
        bad[p.name] = CORRUPTIONS[kind][1]
    foreign = tmp_path / "trajectories" / "ready" / "notes.h5"
    foreign.write_text("not a shard")
    bad[foreign.name] = "unreadable as HDF5"
    good = [_good_shard(tmp_path, s, writer="good") for s in range(3)]
    total_shards, _ = ready_count(tmp_path)
    assert total_shards == len(good) + len(bad)

    res = claim_step(tmp_path, 0, want=100, consumer="trainer-0", timeout_s=0, allow_partial=True)

    assert sorted(t.task_id for t in res.trajectories) == sorted(f"good{s}-{i}" for s in range(3) for i in range(2))
    assert sorted(p.name for p in res.shards) == sorted(p.name for p in good)
    q = tmp_path / "trajectories" / "quarantine"
    assert sorted(p.name for p in res.quarantined) == sorted(bad)
    for name, words in bad.items():
        assert (q / name).exists()
        assert words in (q / f"{name}{REASON_SUFFIX}").read_text()
    assert ready_count(tmp_path) == (0, 0)


def test_quarantine_off_stops_the_claim_with_the_error(tmp_path):
    p = _good_shard(tmp_path, 1)
    _truncate(p)
    with pytest.raises(ShardError, match="truncated"):
        claim_step(tmp_path, 0, want=1, consumer="t", timeout_s=0, quarantine_invalid=False)


def test_a_renamed_copy_of_a_valid_shard_stays_valid(tmp_path):
    # validation is by content, not by file name: a shard moved by an operator still reads
    p = _good_shard(tmp_path, 1)
    q = tmp_path / "copy.h5"
    shutil.copy(p, q)
    assert [t.task_id for t in read_shard(q)] == ["w1-0", "w1-1"]
