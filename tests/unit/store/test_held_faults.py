"""What held under the independent chaos run, kept true: a zero-byte or foreign file dropped
into ``ready/`` next to a shard being claimed is quarantined with its reason, and the good
shards are still trained (the corrupt and truncated cases: ``test_store_corrupt.py``)."""

import numpy as np

from neon_hpc.config.store import StoreConfig
from neon_hpc.store import ShardWriter, claim_step, ready_count
from neon_hpc.store.claim import REASON_SUFFIX
from neon_hpc.store.synthetic import make_trajectory


def test_zero_byte_and_foreign_files_in_ready_are_quarantined_with_reasons(tmp_path):
    ready = tmp_path / "trajectories" / "ready"
    with ShardWriter(tmp_path, "w0", StoreConfig(fsync=False)) as w:
        rng = np.random.default_rng(0)
        for i in range(2):
            w.add(make_trajectory(rng, 40, num_experts=16, task_id=f"good-{i}"))
    (ready / "zero.h5").write_bytes(b"")
    (ready / "foreign.h5").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 100)
    res = claim_step(tmp_path, 0, want=100, consumer="trainer-0", timeout_s=0, allow_partial=True)
    assert sorted(t.task_id for t in res.trajectories) == ["good-0", "good-1"]
    q = tmp_path / "trajectories" / "quarantine"
    assert sorted(p.name for p in res.quarantined) == ["foreign.h5", "zero.h5"]
    for name in ("foreign.h5", "zero.h5"):
        reason = (q / f"{name}{REASON_SUFFIX}").read_text()
        assert name in reason and len(reason) > len(name) + 10, reason
    assert ready_count(tmp_path) == (0, 0)
