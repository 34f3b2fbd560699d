"""The chaos harness, short (issue 20, item 4): one real tiny run whose launcher is SIGKILLed
after a step; its trainer, node, engine and workers must stop by themselves (fault 2), the
rerun must wait for the lease (fault 3) and complete, and every invariant must hold.

The long campaign is `python tools/chaos.py --trials 20` (random roles at random moments)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from repo_paths import REPO


@pytest.mark.slow
def test_a_killed_launcher_leaves_nothing_behind_and_the_rerun_completes(tmp_path):
    report = tmp_path / "trials.jsonl"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "chaos.py"), "--trials", "1", "--moment", "launcher",
                        "--steps", "2", "--delay-s", "0", "--work-dir", str(tmp_path / "work"),
                        "--report", str(report)],
                       cwd=REPO, capture_output=True, text=True, timeout=1800)
    trial = json.loads(report.read_text().splitlines()[0])
    assert trial["injected"], trial                        # the launcher was killed mid-run
    assert trial["problems"] == [], "\n".join(trial["problems"])
    assert "RESULT chaos_trials=1 chaos_invariant_failures=0 chaos_faults_injected=1" in r.stdout, r.stdout[-2000:]
