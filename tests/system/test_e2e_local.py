"""The main job, end to end, as local processes: `neon-hpc run configs/tiny_cpu.yaml`.

One run (module fixture) with a rollout worker SIGKILLed mid-run; the tests then read what it
left: every published shard consumed exactly once or still ready, weights published and
loaded by the engine, versions recorded per token, staleness within the bound, nothing left
running, and status/tail on the finished run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from neon_hpc.config.launch import parse_cpus, split_cpus, trainer_threads
from neon_hpc.protocol.rundir import RunDir, read_json
from neon_hpc.util.logs import read_metrics
from repo_paths import REPO

pytestmark = pytest.mark.slow
NEON = [sys.executable, "-m", "neon_hpc.cli"]
STEPS = 8


def _procs_of(run_root: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_root) in part for part in (p.info["cmdline"] or [])) and p.pid != os.getpid():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e") / "run"
    # the embedded default as shipped (its episodes are what weight updates land in), shorter
    # a small warm start (demonstrations + SFT) and eval set: the run's shape, not its learning
    cmd = NEON + ["run", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(root),
                  "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=2",
                  "--set", "warm_start.demos=16", "--set", "warm_start.steps=2", "--set", "eval.num_tasks=4"]
    lists = split_cpus(sorted(os.sched_getaffinity(0)))     # the two groups on disjoint CPUs
    pinned = None
    if lists:
        pinned = {g: parse_cpus(c) for g, c in lists.items()}
        cmd += [x for g, c in lists.items() for x in ("--set", f"launch.{g}.local_cpus='{c}'")]
    log = open(root.parent / "launcher.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    killed = None
    live = {}
    deadline = time.monotonic() + 900
    run = RunDir(root)
    try:
        # once the trainer has consumed data, SIGKILL rollout worker 0 in the middle of its work
        while proc.poll() is None and time.monotonic() < deadline:
            if not live and read_metrics(root, "trainer"):
                # what an operator sees while the job runs
                live["status"] = subprocess.run(NEON + ["status", str(root)], capture_output=True, text=True)
                live["tail"] = subprocess.run(NEON + ["tail", str(root), "--role", "rollout", "-n", "2"],
                                              capture_output=True, text=True)
            if killed is None and read_metrics(root, "trainer"):
                hb = read_json(run.heartbeat_file("rollout", 0))
                if hb and hb.get("pid") and not hb.get("stopped"):
                    try:
                        live["worker_cpus"] = set(psutil.Process(int(hb["pid"])).cpu_affinity())
                        trainers = [p for p in _procs_of(root) if "trainer" in " ".join(p.cmdline())]
                        live["trainer_cpus"] = [set(p.cpu_affinity()) for p in trainers]
                        live["trainer_threads"] = [p.environ().get("OMP_NUM_THREADS") for p in trainers]
                    except psutil.Error:
                        pass
                    os.kill(int(hb["pid"]), signal.SIGKILL)
                    killed = int(hb["pid"])
            time.sleep(0.5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
            pytest.fail(f"the run did not finish in 900 s; see {root.parent / 'launcher.out'}")
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"root": root, "rc": proc.returncode, "killed": killed, "live": live, "pinned": pinned,
            "out": (root.parent / "launcher.out").read_text()}


def test_run_completes_with_summary(finished_run):
    assert finished_run["rc"] == 0, finished_run["out"][-3000:]
    out = finished_run["out"]
    assert "--- summary" in out and "versions spanned per trajectory" in out
    assert "versions spanned per trained trajectory (token by token)" in out and "wasted rollout tokens" in out
    trainer = read_metrics(finished_run["root"], "trainer")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    assert (finished_run["root"] / "plots" / "run.png").exists()


def test_warm_start_then_eval_before_and_after_in_summary_json(finished_run):
    root = finished_run["root"]
    s = read_json(root / "summary.json")
    for k in ("eval_success_start", "eval_success_end", "trained_spanning_ge2", "wasted_rollout_tokens"):
        assert k in s and s[k] is not None, k
    assert 0.0 <= s["eval_success_start"] <= 1.0 and 0.0 <= s["eval_success_end"] <= 1.0
    start, end = read_json(root / "eval" / "start.json"), read_json(root / "eval" / "end.json")
    assert (start["version"], end["version"]) == (0, STEPS) and start["temperature"] == end["temperature"] == 0.0
    assert [t["task_id"] for t in start["tasks"]] == [t["task_id"] for t in end["tasks"]]   # the same tasks
    assert all(t["task_id"].startswith("tiny-test_id-") for t in end["tasks"])
    # RL started from the SFT checkpoint of the warm start
    assert s["warm_start"]["checkpoint"] == str(root / "warm_start" / "checkpoints" / "step_2")
    assert "initial weights from " + s["warm_start"]["checkpoint"] in (root / "logs" / "trainer" / "0.log").read_text()
    assert "eval success (greedy, 4 held-out tasks)" in finished_run["out"]


def test_every_published_shard_consumed_exactly_once(finished_run):
    from neon_hpc.store import read_shard
    run = RunDir(finished_run["root"])
    claimed = sorted(run.traj_claimed.glob("step_*/*.h5"))
    ready = sorted(run.traj_ready.glob("*.h5"))
    names = Counter(p.name for p in claimed + ready)
    assert claimed and max(names.values()) == 1, names.most_common(3)
    ids = Counter()
    for p in claimed + ready:
        for t in read_shard(p):  # validates schema, checksum, offsets
            ids[t.metadata["uid"]] += 1
    assert max(ids.values()) == 1, "a trajectory was published twice"
    assert not list(run.traj_quarantine.glob("*.h5")), "a shard of a healthy run was quarantined"
    assert not [p for p in run.traj_tmp.iterdir() if not p.name.startswith(".")]
    trained = sum(r["trajectories"] for r in read_metrics(run.root, "trainer"))
    claimed_trajs = sum(len(read_shard(p)) for p in claimed)
    assert trained <= claimed_trajs  # stale ones are dropped at the claim, and counted


def test_killed_worker_was_restarted(finished_run):
    assert finished_run["killed"] is not None, "the worker was never killed; the test proved nothing"
    events = read_metrics(finished_run["root"], "rollout-node")
    assert any(e.get("event") == "worker_restart" and e.get("worker") == 0 for e in events)


def test_weights_published_and_loaded_by_engine(finished_run):
    run = RunDir(finished_run["root"])
    assert run.weight_versions()[-1] >= STEPS - 1
    assert run.latest_weights()[0] == run.weight_versions()[-1]
    loaded = [e["version"] for e in read_metrics(run.root, "rollout-node") if e.get("event") == "weights_loaded"]
    assert loaded and max(loaded) >= 2 and loaded == sorted(loaded)


def test_versions_recorded_and_staleness_bounded(finished_run):
    from neon_hpc import config
    cfg = config.load(finished_run["root"] / "run.yaml")
    rollout = [r for r in read_metrics(finished_run["root"], "rollout") if "event" not in r]
    assert max(r["version_max"] for r in rollout) >= 1
    trainer = read_metrics(finished_run["root"], "trainer")
    assert all(r["staleness_max"] <= cfg.offpolicy.max_staleness for r in trainer), \
        [r["staleness_max"] for r in trainer]


def test_trained_trajectories_span_versions_token_by_token(finished_run):
    """Weights land inside episodes (in place, between two decode steps, or between turns):
    later tokens record the newer version, for a real share of what was trained; versions
    never go backwards inside a trajectory, and the trainer's own count agrees with the shards."""
    from neon_hpc.store import read_shard
    run = RunDir(finished_run["root"])
    spanning = total = 0
    for p in sorted(run.traj_claimed.glob("step_*/*.h5")):
        for t in read_shard(p):
            gen = t.versions[t.loss_mask.astype(bool)]
            assert (gen >= 0).all() and (t.versions[~t.loss_mask.astype(bool)] == -1).all()
            assert (gen[1:] >= gen[:-1]).all(), "versions went backwards inside a trajectory"
            spanning += len(set(gen.tolist())) >= 2
            total += 1
    trainer = read_metrics(run.root, "trainer")
    spans = Counter()
    for r in trainer:
        spans.update({int(k): int(v) for k, v in (r.get("version_spans") or {}).items()})
    trained_multi = sum(v for k, v in spans.items() if k >= 2)
    assert sum(spans.values()) == sum(r["trajectories"] for r in trainer)
    assert trained_multi <= spanning                 # what trained is among what was claimed
    # the share depends on timing (where a swap lands in a response), so it is measured by the
    # run's summary, not asserted here: full runs of the shipped config give 24-36% (README; an
    # earlier config gave 6-13%, and the first 8 steps of one CI-equivalent run near idle gave 2
    # of 128, below a 3% bound this test once had). What can be asserted is that weights do land inside
    # trained trajectories;
    # that two spans come from one response in flight is tests/unit/rollout/test_weight_update_inplace.py's
    assert trained_multi >= 1, dict(spans)


def test_nothing_left_running(finished_run):
    time.sleep(1.0)
    assert _procs_of(finished_run["root"]) == []


def test_status_and_tail_on_live_run(finished_run):
    st, tl = finished_run["live"]["status"], finished_run["live"]["tail"]
    assert st.returncode == 0, st.stderr
    assert "trainer   step=" in st.stdout and "rollout" in st.stdout and "age=" in st.stdout
    assert "versions  " in st.stdout and "wasted    " in st.stdout   # version spans and waste, live
    assert tl.returncode == 0 and "[0] " in tl.stdout and "[1] " in tl.stdout  # both workers' logs


def test_status_and_tail_on_finished_run(finished_run):
    root = str(finished_run["root"])
    r = subprocess.run(NEON + ["status", root], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert f"step={STEPS}" in r.stdout and "heartbeats" in r.stdout
    r = subprocess.run(NEON + ["tail", root, "--role", "trainer", "-n", "3"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "job=local trainer[0]" in r.stdout


def test_the_groups_run_on_their_local_cpus(finished_run):
    """launch.<group>.local_cpus: a rollout worker (a grandchild of the rollout node) and the
    trainer run on their group's CPUs only."""
    pinned, live = finished_run["pinned"], finished_run["live"]
    if pinned is None:
        pytest.skip("one CPU: nothing to pin the two groups apart on")
    assert live.get("worker_cpus") == pinned["rollout"], live
    assert live.get("trainer_cpus") and all(c == pinned["train"] for c in live["trainer_cpus"]), live
    # one torch thread per CPU of its own (launch.config.trainer_threads), unless the operator set it
    want = os.environ.get("OMP_NUM_THREADS") or str(trainer_threads(len(pinned["train"]), 1, beside_rollout=False))
    assert live.get("trainer_threads") and all(t == want for t in live["trainer_threads"]), live
