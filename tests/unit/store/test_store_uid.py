"""Exactly once by trajectory uid (issue 33): a valid shard published again under a new name
never trains twice.

Shard names make files unique, not their content: a copy of a claimed shard put back into
ready/ (an operator, a writer retrying a publish) is a new, valid shard.  The claim skips every
trajectory whose ``metadata["uid"]`` a committed claim of the last ``uid_window_steps`` steps
consumed, counts it (ClaimResult, CLAIM.json, the trainer's metrics, ``neon-hpc status``), and
reads the window back from the committed CLAIM.json files, so a restarted process (a fresh
cache) skips the same ones.
"""

import json
import shutil
import zlib

import numpy as np
import pytest

from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.store import ShardWriter, claim as claim_mod, claim_step
from neon_hpc.store.claim import CLAIM_FILE
from neon_hpc.store.synthetic import make_trajectory

CFG = StoreConfig(fsync=False)


def _publish(run, tag: str, uids: list[str | None]):
    rng = np.random.default_rng(zlib.crc32(tag.encode()))   # the same in every process (str hash() is salted)
    with ShardWriter(run, f"w-{tag}", CFG) as w:
        for i, uid in enumerate(uids):
            t = make_trajectory(rng, 20, task_id=f"{tag}-{i}")
            if uid is not None:
                t.metadata["uid"] = uid
            w.add(t)
    return w.published[0].path


def _republish(run, shard, new_writer: str):
    """The same bytes under a new, valid name (a fresh writer session): what the issue's chaos run did."""
    rd = RunDir(run)
    name = shard.name.split(".")
    name[1], name[2] = new_writer, "feedface"
    dst = rd.traj_ready / ".".join(name)
    shutil.copyfile(shard, dst)
    return dst


def _uids(res):
    return [t.metadata.get("uid") for t in res.trajectories]


def test_a_shard_published_again_under_a_new_name_never_trains_twice(tmp_path):
    first = _publish(tmp_path, "a", ["w0-0", "w0-1", "w0-2"])
    res0 = claim_step(tmp_path, 0, want=3, consumer="trainer-0", timeout_s=0)
    assert _uids(res0) == ["w0-0", "w0-1", "w0-2"] and res0.duplicates == 0
    claimed = RunDir(tmp_path).claimed_step(0) / first.name
    _republish(tmp_path, claimed, "again")
    _publish(tmp_path, "b", ["w1-0", "w1-1", "w1-2"])
    res1 = claim_step(tmp_path, 1, want=3, consumer="trainer-0", timeout_s=0)
    assert _uids(res1) == ["w1-0", "w1-1", "w1-2"]        # the copy's three were skipped
    assert res1.duplicates == 3 and len(res1.shards) == 2  # the copy is consumed (moved), not handed out
    rec = json.loads((RunDir(tmp_path).claimed_step(1) / CLAIM_FILE).read_text())
    assert rec["uids"] == ["w1-0", "w1-1", "w1-2"]
    assert [(d["uid"], d["step"]) for d in rec["duplicates"]] == [("w0-0", 0), ("w0-1", 0), ("w0-2", 0)]
    again = claim_step(tmp_path, 1, want=3, consumer="trainer-0", timeout_s=0)   # replay: same data, same count
    assert again.resumed and _uids(again) == _uids(res1) and again.duplicates == 3


def test_the_remembered_uids_survive_a_restart(tmp_path, monkeypatch):
    """A new process has an empty cache: the window is read back from the committed CLAIM.json files."""
    first = _publish(tmp_path, "a", ["u-0", "u-1"])
    claim_step(tmp_path, 0, want=2, consumer="trainer-0", timeout_s=0)
    monkeypatch.setattr(claim_mod, "_CONSUMED", {})            # what a restart starts with
    _republish(tmp_path, RunDir(tmp_path).claimed_step(0) / first.name, "again")
    _publish(tmp_path, "b", ["u-2"])
    res = claim_step(tmp_path, 1, want=1, consumer="trainer-0", timeout_s=0)
    assert _uids(res) == ["u-2"] and res.duplicates == 2


def test_duplicates_inside_one_claim_and_trajectories_without_uid(tmp_path):
    _publish(tmp_path, "a", ["x", "x", None, None])            # the same uid twice in one shard; two without
    res = claim_step(tmp_path, 0, want=3, consumer="trainer-0", timeout_s=0)
    assert _uids(res) == ["x", None, None] and res.duplicates == 1


def test_the_window_is_uid_window_steps(tmp_path):
    """A uid is remembered for the ``uid_window_steps`` steps after the claim that consumed it."""
    first = _publish(tmp_path, "a", ["old-0"])
    claim_step(tmp_path, 0, want=1, consumer="trainer-0", timeout_s=0)
    original = RunDir(tmp_path).claimed_step(0) / first.name
    for s in (1, 2):
        _publish(tmp_path, f"f{s}", [f"fill-{s}"])
        claim_step(tmp_path, s, want=1, consumer="trainer-0", timeout_s=0)
    _republish(tmp_path, original, "again")
    _publish(tmp_path, "f3", ["fill-3"])
    inside = claim_step(tmp_path, 3, want=1, consumer="trainer-0", timeout_s=0, uid_window_steps=3)
    assert inside.duplicates == 1 and _uids(inside) == ["fill-3"]     # step 0 is 3 steps back: inside
    _republish(tmp_path, original, "thrice")
    outside = claim_step(tmp_path, 4, want=1, consumer="trainer-0", timeout_s=0, uid_window_steps=3)
    assert outside.duplicates == 0 and _uids(outside) == ["old-0"]   # 4 steps back: forgotten
    with pytest.raises(ValueError, match="uid_window_steps"):
        claim_step(tmp_path, 5, want=1, consumer="trainer-0", timeout_s=0, uid_window_steps=0)


def test_status_shows_the_duplicates_the_trainer_reported(tmp_path):
    from neon_hpc.ops.status import collect, render
    from neon_hpc.util.logs import RoleLogger
    run = RunDir(tmp_path / "run").create()
    log = RoleLogger.open(run.root, "trainer", 0, echo=False)
    log.metrics(step=1, tokens=10, duplicates_skipped=3)
    log.metrics(step=2, tokens=10, duplicates_skipped=2)
    log.metrics(step=2, tokens=10, duplicates_skipped=2)     # step 2 trained again after a resume: counted once
    log.close()
    info = collect(run.root)
    assert info["duplicates_skipped"] == 5
    assert "duplicates skipped=5" in render(info)
