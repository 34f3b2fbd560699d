"""The launcher reads the trainer's metrics.jsonl incrementally (logs.MetricsTail): only the
bytes appended since its last look, a line still being written is held back until its
newline, and a truncated or replaced file is read again from its start."""

from __future__ import annotations

import json
import os

from neon_hpc import config
from neon_hpc.launch.local import LocalRun
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import MetricsTail, RoleLogger, metrics_path
from repo_paths import REPO


def _line(step: int) -> bytes:
    return (json.dumps({"time": 1.0 + step, "step": step, "reward_mean": 0.5}) + "\n").encode()


def test_only_new_bytes_are_read_and_a_partial_line_waits_for_its_newline(tmp_path):
    log = RoleLogger.open(tmp_path, "trainer", 0, echo=False)
    tail = MetricsTail(tmp_path, "trainer")
    assert tail.read() == []                                  # nothing written yet
    for step in (1, 2):
        log.set(step=step)
        log.metrics(loss=0.1 * step)
    assert [r["step"] for r in tail.read()] == [1, 2]
    size = metrics_path(tmp_path, "trainer").stat().st_size
    assert tail.bytes_read == size and tail.read() == [] and tail.bytes_read == size   # idle: no re-read
    log.set(step=3)
    log.metrics(loss=0.3)
    assert [r["step"] for r in tail.read()] == [3]
    grown = metrics_path(tmp_path, "trainer").stat().st_size
    assert tail.bytes_read == grown                           # the new record's bytes, nothing more
    log.close()

    p = metrics_path(tmp_path, "trainer")
    rec = _line(4)
    with open(p, "ab") as f:                                  # a writer mid-line
        f.write(rec[:10])
    assert tail.read() == []
    with open(p, "ab") as f:
        f.write(rec[10:])
    assert [r["step"] for r in tail.read()] == [4]
    assert tail.restarts == 0


def test_a_truncated_file_is_read_again_from_its_start(tmp_path):
    p = metrics_path(tmp_path, "trainer")
    p.parent.mkdir(parents=True)
    p.write_bytes(_line(1) + _line(2) + _line(3))
    tail = MetricsTail(tmp_path, "trainer")
    assert len(tail.read()) == 3
    with open(p, "r+b") as f:                                 # same inode, fewer bytes
        f.truncate(0)
        f.write(_line(7))
    assert [r["step"] for r in tail.read()] == [7] and tail.restarts == 1


def test_a_replaced_file_is_read_from_its_start_even_when_longer(tmp_path):
    p = metrics_path(tmp_path, "trainer")
    p.parent.mkdir(parents=True)
    p.write_bytes(_line(1))
    tail = MetricsTail(tmp_path, "trainer")
    assert len(tail.read()) == 1
    new = p.with_name("metrics.jsonl.new")                    # rotation: another inode, more bytes
    new.write_bytes(b"".join(_line(s) for s in (11, 12, 13)))
    os.replace(new, p)
    assert [r["step"] for r in tail.read()] == [11, 12, 13] and tail.restarts == 1
    # rewritten in place (same inode) past the old offset: the first bytes differ
    with open(p, "r+b") as f:
        f.truncate(0)
        f.write(b"".join(_line(s) for s in (21, 22, 23, 24)))
    assert [r["step"] for r in tail.read()] == [21, 22, 23, 24] and tail.restarts == 2


def test_the_launcher_shows_each_new_step_once(tmp_path, capsys):
    cfg = config.load(str(REPO / "configs" / "tiny_cpu.yaml"), ["train.steps=3"])
    run = RunDir(tmp_path / "run").create()
    lr = LocalRun(cfg, run)
    log = RoleLogger.open(run.root, "trainer", 0, echo=False)
    for step in (1, 2):
        log.set(step=step)
        log.metrics(reward_mean=0.25, trajectories=8)
    lr.progress()
    lr.progress()                                             # nothing new: nothing shown
    log.set(step=3)
    log.metrics(reward_mean=0.75, trajectories=8)
    lr.progress()
    log.close()
    lr.log.close()
    shown = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert shown == ["1/3", "2/3", "3/3"]
