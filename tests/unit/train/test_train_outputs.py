"""``train.outputs.StepOutputs``'s checkpoint rule: by count, by time (rank 0's clock), at the last
step and on a stop; the clock and the save are the test's (the saves themselves are tested in
``test_train_checkpoint_async.py``)."""

from __future__ import annotations

import dataclasses
import types

from neon_hpc import config as C
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.train import outputs as O
from neon_hpc.train.sections import TrainerSections
from repo_paths import REPO


def _outputs(tmp_path, monkeypatch, rank=0, **train):
    cfg = C.load(REPO / "configs" / "tiny_cpu.yaml")
    train = {"checkpoint_async": False, "publish_every": 10 ** 6, "steps": 100, **train}
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    saved, clock = [], {"now": 1000.0}
    monkeypatch.setattr(O.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(O.ckpt, "save", lambda run, be, step, state: saved.append(step))
    log = types.SimpleNamespace(info=lambda *a: None, error=lambda *a: None)
    out = O.StepOutputs(RunDir(str(tmp_path / "run")).create(), None, TrainerSections.of(cfg), log, rank)
    out.publisher = None          # no backend here to snapshot at the last step's publish
    return out, saved, clock


def _run(out, clock, steps, dt, stop_at=None):
    for step in steps:
        clock["now"] += dt
        out.after_step(step, step == stop_at, {}, {}, timed=out.time_due())


def test_by_time_the_first_step_past_the_interval_checkpoints_and_restarts_the_clock(tmp_path, monkeypatch):
    out, saved, clock = _outputs(tmp_path, monkeypatch, checkpoint_every=0, checkpoint_every_s=60.0)
    _run(out, clock, range(1, 31), dt=7.0)      # 7 s steps: due at 63 s, then 63 s after that, ...
    assert saved == [9, 18, 27]


def test_by_count_and_by_time_together_and_the_last_step_and_a_stop(tmp_path, monkeypatch):
    out, saved, clock = _outputs(tmp_path, monkeypatch, checkpoint_every=10, checkpoint_every_s=25.0, steps=24)
    _run(out, clock, range(1, 25), dt=2.0)
    assert saved == [10, 20, 24]                 # the count restarts the clock: 25 s never pass
    out, saved, clock = _outputs(tmp_path / "b", monkeypatch, checkpoint_every=0, checkpoint_every_s=0.0)
    _run(out, clock, range(1, 8), dt=100.0, stop_at=7)
    assert saved == [7]                          # neither rule: only the stop


def test_only_rank_0_s_clock_says_due(tmp_path, monkeypatch):
    out, _, clock = _outputs(tmp_path, monkeypatch, rank=1, checkpoint_every_s=1.0)
    clock["now"] += 100.0
    assert not out.time_due()
