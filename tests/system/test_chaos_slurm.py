"""The chaos harness on the real Slurm het job, short (issue 20, item 4): every task process
of the rollout group's srun step (the rollout node, its engine and its workers) is SIGKILLed
at once after the first trainer step, as when a node dies under a living slurmstepd. The job
must fail rather than hang, leave no process and no job behind, and a relaunch of the same
run directory must complete with every invariant holding.

The campaign (scancel of a component, kill-node, requeue): `python tools/chaos.py --backend
slurm --trials 3`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from repo_paths import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_killed_rollout_node_fails_the_job_and_the_relaunch_completes(slurm_cluster, tmp_path):
    report = tmp_path / "trials.jsonl"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "chaos.py"), "--backend", "slurm",
                        "--cluster-dir", str(slurm_cluster.root), "--moment", "kill-node", "--component", "0",
                        "--trials", "1", "--steps", "2", "--delay-s", "0", "--work-dir", str(tmp_path / "work"),
                        "--report", str(report)], cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert report.exists(), r.stdout[-2000:] + r.stderr[-2000:]
    trial = json.loads(report.read_text().splitlines()[0])
    assert trial["injected"] and "rollout node" in trial["fault"], trial
    assert trial["problems"] == [], "\n".join(trial["problems"])
    assert len(trial["jobs"]) >= 2                        # the killed job, then the relaunch that completed
    assert "RESULT chaos_trials=1 chaos_invariant_failures=0 chaos_faults_injected=1" in r.stdout, r.stdout[-2000:]
