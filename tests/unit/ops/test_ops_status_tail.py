"""status, tail and plot on a run directory with real files (no processes needed)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from neon_hpc.ops import status as st
from neon_hpc.ops.plot import plot_run
from neon_hpc.ops.tail import tail
from neon_hpc.protocol.rundir import RunDir, atomic_write_json
from neon_hpc.util.logs import RoleLogger


def _fake_run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run").create()
    tr = RoleLogger.open(run.root, "trainer", 0, echo=False)
    for s in range(1, 4):
        tr.set(step=s)
        tr.info("step %d done", s)
        tr.metrics(step=s, version=s, step_time_s=1.0, wait_s=0.5, tokens=100, trajectories=4,
                   tokens_per_s=100.0, reward_mean=0.1 * s, staleness_mean=0.5, staleness_max=1,
                   staleness_hist={"0": 50, "1": 50})
    tr.error("something broke on purpose")
    for w in range(2):
        ro = RoleLogger.open(run.root, "rollout", w, echo=False)
        ro.info("worker %d up", w)
        ro.metrics(worker=w, task_id="t", tokens=30, gen_tokens=10, episode_s=0.2, version_min=0,
                   version_max=1, reward=1.0, turns=2)
        ro.close()
        run.beat("rollout", w, in_flight=0)
    (run.weights_version(3)).mkdir()
    run.publish_latest(3)
    (run.checkpoint(2)).mkdir()
    (run.traj_ready / "a.h5").write_bytes(b"")
    (run.claimed_step(1)).mkdir(parents=True)
    (run.claimed_step(1) / "b.h5").write_bytes(b"")
    atomic_write_json(run.state / "job.json", {"job_id": "local", "backend": "local"})
    tr.close()
    return run


def test_status_reports_the_run(tmp_path):
    run = _fake_run(tmp_path)
    info = st.collect(run.root)
    assert info["trainer_step"] == 3 and info["weights_latest"] == 3 and info["checkpoint"] == 2
    assert info["shards"] == {"ready": 1, "claimed": 1, "quarantined": 0, "writing": 0}
    assert {(h["role"], h["rank"]) for h in info["heartbeats"]} == {("rollout", 0), ("rollout", 1)}
    assert any("something broke on purpose" in e for e in info["errors"])
    text = st.render(info)
    assert "step=3" in text and "weights=v_3" in text and "ready=1" in text and "0:50 1:50" in text
    assert st.main([str(run.root), "--json"]) == 0


def test_status_on_a_non_run(tmp_path):
    with pytest.raises(Exception, match="not a neon-hpc run directory"):
        st.collect(tmp_path)


def test_tail_all_ranks_and_one_rank(tmp_path):
    run = _fake_run(tmp_path)
    out = io.StringIO()
    tail(str(run.root), "rollout", None, n=5, out=out)
    lines = out.getvalue().splitlines()
    assert any(l.startswith("[0] ") and "worker 0 up" in l for l in lines)
    assert any(l.startswith("[1] ") and "worker 1 up" in l for l in lines)
    out = io.StringIO()
    tail(str(run.root), "rollout", "1", n=5, out=out)
    assert "worker 1 up" in out.getvalue() and "worker 0 up" not in out.getvalue()
    with pytest.raises(SystemExit, match="roles with logs: .*rollout"):
        tail(str(run.root), "nosuchrole")


def test_tail_follow_sees_new_lines_line_by_line(tmp_path):
    run = _fake_run(tmp_path)
    out = io.StringIO()
    th = threading.Thread(target=tail, args=(str(run.root), "trainer", "0"),
                          kwargs=dict(n=0, follow=True, out=out, poll_s=0.05, max_s=3.0))
    th.start()
    time.sleep(0.5)
    log = run.log_dir("trainer") / "0.log"
    with open(log, "a") as f:
        f.write("first new line\nsecond ha")
        f.flush()
        time.sleep(0.4)
        f.write("lf done\n")
    th.join()
    got = out.getvalue().splitlines()
    assert got == ["first new line", "second half done"]


def test_plot_writes_png(tmp_path):
    run = _fake_run(tmp_path)
    p = plot_run(str(run.root))
    assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
