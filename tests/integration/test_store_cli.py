"""`neon-hpc shard inspect | verify | ls` print what a human needs and exit non-zero on bad shards."""

import json
import subprocess
import sys

import numpy as np

from neon_hpc.config.store import StoreConfig
from neon_hpc.store import ShardWriter, claim_step
from neon_hpc.store.cli import main
from neon_hpc.store.synthetic import make_trajectory
from repo_paths import REPO


def _shard(run, n=3, writer="rollout-0"):
    rng = np.random.default_rng(0)
    with ShardWriter(run, writer, StoreConfig(fsync=False)) as w:
        for i in range(n):
            w.add(make_trajectory(rng, 30 + i, task_id=f"xrd-{i}", group_id="g0"))
    return w.published[0].path


def test_inspect_prints_summary_table_and_one_trajectory(tmp_path, capsys):
    p = _shard(tmp_path)
    assert main(["inspect", str(p), "--index", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 trajectories, 93 tokens" in out and "writer     rollout-0" in out
    assert "valid:" in out and "xrd-1" in out and "trajectory 2: task_id='xrd-2'" in out


def test_inspect_json_and_the_tool_script(tmp_path):
    p = _shard(tmp_path)
    root = REPO
    out = subprocess.run([sys.executable, str(root / "tools" / "inspect_shard.py"), str(p), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["valid"] and [t["task_id"] for t in obj["trajectories"]] == ["xrd-0", "xrd-1", "xrd-2"]


def test_verify_fails_on_a_truncated_shard(tmp_path, capsys):
    p = _shard(tmp_path)
    data = p.read_bytes()
    bad = tmp_path / "bad.h5"
    bad.write_bytes(data[: len(data) // 3])
    assert main(["verify", str(p), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "ok       " in out and f"INVALID  {bad}" in out


def test_inspect_refuses_a_corrupt_digest_named_shard_without_opening_it(tmp_path, capsys):
    p = _shard(tmp_path)
    raw = bytearray(p.read_bytes())
    raw[1993] ^= 0xFF                 # a header byte: unchecked, libhdf5 crashed on such a flip
    p.write_bytes(bytes(raw))
    assert main(["inspect", str(p)]) == 1
    assert "file digest mismatch" in capsys.readouterr().err
    assert main(["verify", str(p)]) == 1


def test_ls_counts_ready_claimed_and_quarantine_with_reasons(tmp_path, capsys):
    _shard(tmp_path, writer="a")
    claim_step(tmp_path, 0, want=3, consumer="trainer-0", timeout_s=0)
    _shard(tmp_path, writer="b")
    (tmp_path / "trajectories" / "ready" / "junk.h5").write_text("junk")
    claim_step(tmp_path, 1, want=6, consumer="trainer-0", timeout_s=0, allow_partial=True)
    _shard(tmp_path, writer="c")
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ready       1 shards, 3 trajectories" in out
    assert "claimed     2 committed steps (0..1)" in out
    assert "quarantine  1 files" in out and "junk.h5: unreadable as HDF5" in out
