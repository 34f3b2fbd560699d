"""A full or read-only filesystem (issue 20, item 6): a rollout worker's shard publish and the
trainer's checkpoint fail naming the path, leave nothing partial, and work again once space
is back. The run directory lives on a real, small tmpfs mounted for the test (root only)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from neon_hpc.protocol.rundir import RunDir, StorageError, atomic_write_json
from neon_hpc.util.netutil import free_port
from repo_paths import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not sys.platform.startswith("linux"),
                                reason="mounting a small tmpfs needs root on Linux")


@pytest.fixture
def small_fs(tmp_path):
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(fs: Path) -> Path:
    """Take every free byte of ``fs`` (unbuffered writes: 1 MiB, then 4 KiB, until ENOSPC)."""
    f = fs / "filler"
    with open(f, "wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12):
            try:
                while True:
                    out.write(b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    return f


def test_a_shard_publish_on_a_full_disk_names_the_shard_and_succeeds_once_space_is_back(small_fs):
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.store import ShardWriter
    from neon_hpc.store.reader import read_shard
    from neon_hpc.store.synthetic import make_trajectory

    run = RunDir(small_fs / "run").create()
    w = ShardWriter(run.root, "w0", StoreConfig(flush_trajectories=1000))
    rng = np.random.default_rng(0)
    for _ in range(8):
        w.add(make_trajectory(rng, 2000))
    filler = fill(small_fs)
    with pytest.raises(StorageError) as e:
        w.flush()
    assert str(run.traj_ready) in str(e.value) and "No space left on device" in str(e.value)
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(run.traj_tmp) == [] and os.listdir(run.traj_ready) == []    # nothing partial
    filler.unlink()
    path = w.flush()                     # the buffered trajectories were kept
    assert len(read_shard(path)) == 8 and os.listdir(run.traj_tmp) == []


def test_a_state_write_on_a_read_only_filesystem_names_the_file(small_fs):
    run = RunDir(small_fs / "run").create()
    atomic_write_json(run.state / "job.json", {"starts": 1})
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(StorageError) as e:
            atomic_write_json(run.state / "job.json", {"starts": 2})
        assert e.value.errno == errno.EROFS and str(run.state / "job.json") in str(e.value)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert json.loads((run.state / "job.json").read_text()) == {"starts": 1}    # the old file, whole
    atomic_write_json(run.state / "job.json", {"starts": 2})
    assert json.loads((run.state / "job.json").read_text()) == {"starts": 2}
    assert [n for n in os.listdir(run.state) if ".tmp." in n] == []


TRAINER = r"""
import json, os, sys
from pathlib import Path
from neon_hpc.config.model import ModelConfig
from neon_hpc.protocol.rundir import RunDir, StorageError
from neon_hpc.train import backend as B, checkpoint as ckpt
fs = Path(sys.argv[1])
run = RunDir(fs / "run").create()
be = B.setup(ModelConfig(), seed=1)
filler = fs / "filler"
with open(filler, "wb") as f:
    try:
        while True:
            f.write(b"\0" * (1 << 16)); f.flush()
    except OSError:
        pass
out = {}
try:
    ckpt.save(run, be, 1, {"version": 1})
    out["first"] = "saved"
except StorageError as e:
    out["first"] = str(e); out["errno"] = e.errno
out["left"] = sorted(os.listdir(run.checkpoints))
filler.unlink()
ckpt.save(run, be, 1, {"version": 1})
out["after"] = sorted(os.listdir(run.checkpoints))
print(json.dumps(out))
B.teardown()
"""


@pytest.mark.slow
def test_a_checkpoint_on_a_full_disk_names_it_leaves_nothing_and_saves_once_space_is_back(small_fs):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", TRAINER, str(small_fs)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["errno"] == errno.ENOSPC, out
    assert str(small_fs / "run" / "checkpoints" / "step_1") in out["first"] and "No space left" in out["first"]
    assert out["left"] == []                       # no staging sibling, no step_1
    assert out["after"] == ["step_1"]
