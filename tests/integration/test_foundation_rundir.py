"""Atomic publish: a writer SIGKILLed at any moment never leaves a visible partial file."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neon_hpc.protocol import rundir
from neon_hpc.protocol.rundir import RunDir, RunDirError

WRITER = r"""
import os, sys, json
from neon_hpc.protocol import rundir
d = sys.argv[1]
i = 0
while True:
    i += 1
    # large payloads make the window between open and rename wide enough to be hit
    payload = bytes([i % 251]) * (256 * 1024 + i % 4096)
    rundir.atomic_write_bytes(os.path.join(d, f"blob_{i % 7}.bin"), payload)
    rundir.atomic_write_json(os.path.join(d, "state.json"), {"i": i, "pad": "x" * (i % 5000)})
"""


def _check_dir(d: Path) -> int:
    n = 0
    for p in d.iterdir():
        if p.name.startswith("."):
            continue  # hidden temporaries of the killed writer: never under a published name
        if p.suffix == ".bin":
            data = p.read_bytes()
            assert len(data) >= 256 * 1024 and data == bytes([data[0]]) * len(data), p
            n += 1
        elif p.name == "state.json":
            obj = json.loads(p.read_text())  # a torn JSON would raise here
            assert len(obj["pad"]) == obj["i"] % 5000
            n += 1
    return n


def test_sigkill_never_leaves_partial_files(tmp_path):
    rng = random.Random(0)
    seen = 0
    for trial in range(12):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
        time.sleep(0.6 + rng.random() * 0.6)  # import time + a random point in the write loop
        p.send_signal(signal.SIGKILL)
        p.wait()
        seen += _check_dir(tmp_path)
    assert seen > 0, "the writer never published anything; the test proved nothing"
    # leftovers of killed writers are hidden and can be swept
    rundir.remove_stale_tmp(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_exception_inside_atomic_file_leaves_old_content(tmp_path):
    target = tmp_path / "x.txt"
    rundir.atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with rundir.atomic_file(target, "w") as f:
            f.write("new but unfinished")
            raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["x.txt"]


def test_heartbeats_skip_the_fsyncs_and_every_other_record_keeps_them(tmp_path, monkeypatch):
    from neon_hpc.protocol.records import Preempted, TrainerBeat

    run = RunDir(str(tmp_path / "run")).create()
    synced = []
    real = os.fsync
    monkeypatch.setattr(rundir.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    TrainerBeat(rank=0, step=3).write(run)
    beat = TrainerBeat.read(run, 0)
    assert synced == [] and beat.step == 3 and beat.pid == os.getpid()   # published, unsynced
    assert [p.name for p in run.heartbeats_dir.iterdir()] == [run.heartbeat_file("trainer", 0).name]
    Preempted(step=3, signal=15, checkpoint="x").write(run)
    assert len(synced) >= 2                                               # the file and its directory


def test_publish_dir_is_all_or_nothing(tmp_path):
    final = tmp_path / "weights" / "v_1"
    st = rundir.staging_dir_for(final)
    (st / "a").write_text("1")
    assert not final.exists()
    rundir.publish_dir(st, final)
    assert (final / "a").read_text() == "1" and not st.exists()
    st2 = rundir.staging_dir_for(final)
    with pytest.raises(RunDirError, match="immutable"):
        rundir.publish_dir(st2, final)


def test_rundir_layout_latest_and_heartbeats(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.check()
    assert run.latest_weights() is None
    with pytest.raises(RunDirError, match="does not exist"):
        run.publish_latest(3)
    (run.weights_version(3)).mkdir()
    run.publish_latest(3)
    assert run.latest_weights() == (3, run.weights_version(3))
    (run.checkpoints / "step_2").mkdir(); (run.checkpoints / "step_10").mkdir(); (run.checkpoints / "junk").mkdir()
    assert run.checkpoint_steps() == [2, 10] and run.latest_checkpoint() == 10
    run.beat("rollout", 1, episodes=5)
    (hb,) = run.heartbeats()
    assert hb["role"] == "rollout" and hb["episodes"] == 5 and hb["age_s"] >= 0


def test_inside_refuses_escapes(tmp_path):
    assert rundir.inside(tmp_path, "a", "b") == (tmp_path / "a" / "b").resolve()
    with pytest.raises(RunDirError, match="escapes"):
        rundir.inside(tmp_path, "../etc/passwd")
    with pytest.raises(RunDirError, match="escapes"):
        rundir.inside(tmp_path, "/etc/passwd")


def test_not_a_run_dir_message(tmp_path):
    with pytest.raises(RunDirError, match="not a neon-hpc run directory"):
        RunDir(tmp_path).check()
