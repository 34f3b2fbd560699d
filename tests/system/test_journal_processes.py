"""A requeue loses no agentic work (issue 41), with real processes: ``neon-hpc run
configs/tiny_long_cpu.yaml`` (episodes of tens of turns) gets SIGUSR1 (the rollout node and its
workers, as Slurm's ``--signal`` sends it) and SIGTERM (the launcher) while episodes are mid-way,
then runs again; in the rerun rollout worker 1 is SIGKILLed mid-turn and restarted by its node.
The module fixture is ``tools/bench_requeue.py``'s run; the tests read what it left: every
journalled episode resumed under the uid it started with and was published once with its
journalled prefix (tokens, loss mask, logprobs, per-token versions, routes) unchanged and
consumed once; the workers were out within seconds of the signal; status and summary show it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from repo_paths import REPO

sys.path.insert(0, str(REPO / "tools"))
import bench_requeue as br  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def requeued(tmp_path_factory):
    root = tmp_path_factory.mktemp("journal") / "run"
    r = br.run_bench(root, steps=8, log=lambda *_: None)
    r["root"] = root
    return r


def test_the_run_resumed_and_finished(requeued):
    assert requeued["rc"] == 0, (requeued["root"].parent / "launcher.out").read_text()[-3000:]


def test_the_signal_stops_the_workers_within_seconds_and_they_say_why(requeued):
    assert requeued["stop_s"] <= 10
    logs = "".join(p.read_text() for p in (requeued["root"] / "logs" / "rollout").glob("*.log"))
    assert "stopping (SIGUSR1)" in logs


def test_every_episode_journalled_at_the_signal_resumes_and_completes(requeued):
    sig = requeued["signal"]
    assert sig["episodes"] >= 2, "nothing was in flight at the signal: the test proved nothing"
    assert sig["missing"] == [] and sig["changed"] == []
    assert sig["resumed_episodes"] == sig["episodes"]
    assert sig["kept_fraction"] >= 0.99, sig


def test_no_token_trained_twice(requeued):
    assert requeued["all_claims_once"] and requeued["duplicated_tokens"] == 0
    trajs, claims = br.published(requeued["root"])
    assert max(len(v) for v in trajs.values()) == 1, "a trajectory was published twice"


def test_a_sigkilled_worker_loses_at_most_the_turn_in_flight(requeued):
    kill = requeued["sigkill"]
    assert kill["episodes"] >= 1, "worker 1 had nothing journalled when it was killed"
    # its records on disk were the last turn boundary each episode reached (none older than what
    # was read just before the kill), and each resumed from exactly there
    assert requeued["sigkill_records_behind"] == []
    assert kill["missing"] == [] and kill["changed"] == []
    logs = (requeued["root"] / "logs" / "rollout-node" / "0.log").read_text()
    assert "rollout worker 1 died (signal 9)" in logs


def test_the_journal_is_cheap(requeued):
    assert requeued["journal_overhead"] <= 0.02


def test_status_and_summary_show_the_resumes(requeued):
    from neon_hpc.launch.summary import render_summary, summarize
    s = summarize(requeued["root"])
    assert s["resumed_episodes"] >= requeued["signal"]["episodes"] + requeued["sigkill"]["episodes"]
    assert s["resumed_tokens_kept"] > 0 and s["resumed_tokens_lost"] == 0
    assert "episodes resumed" in render_summary(s)
    out = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "status", str(requeued["root"])],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
