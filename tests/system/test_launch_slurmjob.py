"""launch.slurmjob: one reading of a job's state for launch --wait, status and the tests; a
heterogeneous job is read component by component (real Slurm for the live and ended cases)."""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest

from neon_hpc.launch.slurmjob import JobState, SlurmUnavailable, _rows, in_queue, query


def test_an_ended_het_job_is_completed_only_if_every_component_is():
    ok = JobState("7", (("7+0", "COMPLETED"), ("7+1", "COMPLETED")), live=False)
    failed = JobState("7", (("7+0", "COMPLETED"), ("7+1", "FAILED")), live=False)
    assert ok.state == "COMPLETED" and ok.final
    assert failed.state == "FAILED" and failed.final     # the first component alone says COMPLETED
    assert failed.describe() == "FAILED (7+0 COMPLETED, 7+1 FAILED)"


def test_a_live_job_runs_while_any_component_runs():
    assert JobState("7", (("7+0", "PENDING"), ("7+1", "RUNNING")), live=True).state == "RUNNING"
    pending = JobState("7", (("7+0", "PENDING"), ("7+1", "PENDING")), live=True)
    assert pending.state == "PENDING" and not pending.final
    assert JobState("7", (), live=False).state == "UNKNOWN"


def test_rows_take_the_first_word_of_a_state():
    assert _rows("7+0|CANCELLED by 0\n7+1|CANCELLED+\nnoise\n8|\n") == (("7+0", "CANCELLED"), ("7+1", "CANCELLED"))


def test_no_slurm_on_the_path_is_said(tmp_path):
    with pytest.raises(SlurmUnavailable, match="squeue"):
        query("1", env=dict(os.environ, PATH=str(tmp_path)))
    assert in_queue("1", env=dict(os.environ, PATH=str(tmp_path))) is None    # no answer is not "gone"


@pytest.mark.slurm
def test_status_reads_every_component_of_a_het_job(slurm_cluster, tmp_path, monkeypatch):
    from neon_hpc.ops import status as st
    from neon_hpc.protocol.rundir import RunDir, atomic_write_json
    script = tmp_path / "het.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH -p rollout -N 1 -n 1 -o {tmp_path}/het_%j.out
        #SBATCH hetjob
        #SBATCH -p train -N 1 -n 1
        touch {tmp_path}/started
        sleep 6
        """))
    job = slurm_cluster.sbatch(str(script))
    run = RunDir(tmp_path / "run").create()
    atomic_write_json(run.state / "job.json", {"job_id": job, "backend": "slurm"})
    for k in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(k, slurm_cluster.env[k])
    end = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < end:
        time.sleep(0.5)
    live = st.collect(run.root)
    assert live["slurm_components"] == {f"{job}+0": "RUNNING", f"{job}+1": "RUNNING"}, live["slurm_components"]
    assert live["slurm_state"] == "RUNNING"
    assert f"{job}+0=RUNNING {job}+1=RUNNING" in st.render(live)
    assert in_queue(job, env=slurm_cluster.env) == "listed"
    assert slurm_cluster.wait(job) == "COMPLETED"
    assert in_queue(job, env=slurm_cluster.env) in ("gone", "listed")   # squeue keeps ended jobs for MinJobAge
    assert in_queue("999999999", env=slurm_cluster.env) in ("unknown", "gone")
    end = time.monotonic() + 60      # sacct gets the records from slurmdbd asynchronously
    while True:
        ended = st.collect(run.root)
        if len(ended["slurm_components"]) == 2 or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert ended["slurm_components"] == {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}
    assert json.loads(json.dumps(ended, default=str))["slurm_state"] == "COMPLETED"
