"""launch.hetjob: submitit's executor for the run's heterogeneous job. The plugin entry point,
the refusals, and on real Slurm (env/cluster.sh) the rendered script of configs/tiny_cpu.yaml
submitted through the executor, with a stand-in python whose roles sleep: both components
tracked, requeue, cancel, and a job that completes."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import tomllib

import pytest
from submitit.core import core, utils

from neon_hpc.launch.hetjob import HetJob, HetJobExecutor, LaunchRefused
from neon_hpc.launch.slurmjob import FINAL, JobState
from repo_paths import REPO

TINY = str(REPO / "configs" / "tiny_cpu.yaml")

# the rendered script's python: the prepare step and the protocol's questions answer as for a
# fresh run; a role writes started.<role> and sleeps STUB_SLEEP seconds
STUB = """#!/bin/bash
case "$2" in
  neon_hpc.launch.roles) touch "$(dirname "$0")/started.$3"; sleep "${STUB_SLEEP:-300}";;
  neon_hpc.protocol)
    case "$3" in path) echo "${@: -1}/run.yaml";; preempted) exit 1;; *) exit 0;; esac;;
  *) exit 0;;
esac
"""


def test_the_plugin_entry_point_is_the_executor():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    value = meta["project"]["entry-points"]["submitit"]["executor"]   # submitit loads the name `executor`
    module, _, name = value.partition(":")
    ex = getattr(importlib.import_module(module), name)
    assert ex is HetJobExecutor and issubclass(ex, core.Executor) and ex.name() == "hetjob"
    assert ex.affinity() <= 0          # never what submitit.AutoExecutor picks by itself


def test_submitit_finds_the_executor_through_the_entry_point(tmp_path):
    """submitit's own plugin discovery, given the entry point pyproject.toml declares (a
    distribution's metadata on sys.path, as an install writes it)."""
    value = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["submitit"]["executor"]
    info = tmp_path / "neon_hpc_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neon-hpc-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[submitit]\nexecutor = {value}\n")
    code = ("import submitit\nfrom submitit.core import plugins\n"
            "ex = plugins.get_executors()['hetjob']\n"
            "auto = submitit.AutoExecutor(sys.argv[1], cluster='hetjob')\n"
            "print(ex.__module__, ex.__name__, type(auto._executor).__name__)\n")
    r = subprocess.run([sys.executable, "-c", "import sys\n" + code, str(tmp_path / "run")], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)])))
    assert r.stdout.split() == ["neon_hpc.launch.hetjob", "HetJobExecutor", "HetJobExecutor"], r.stderr


def test_a_function_is_refused_naming_launch(tmp_path):
    ex = HetJobExecutor(tmp_path)
    with pytest.raises(NotImplementedError, match=r"executor.launch\(\)"):
        ex.submit(print, "x")
    with pytest.raises(ValueError, match="launch section"):
        ex.update_parameters(nodes=4)
    with pytest.raises(ValueError, match="update_parameters\\(config="):
        ex.launch()


def test_warm_start_without_a_checkpoint_is_refused(tmp_path):
    ex = HetJobExecutor(tmp_path / "run")
    ex.update_parameters(config=TINY)
    with pytest.raises(LaunchRefused, match="neon-hpc sft .*warm_start.enabled=false"):
        ex.launch()
    assert not (tmp_path / "run").exists()      # refused before anything is written


def test_a_requeue_record_outside_squeue_has_ended():
    gone = JobState("7", (("7+0", "REQUEUED"), ("7+1", "CANCELLED")), live=False)
    assert gone.state == "CANCELLED" and gone.final
    assert JobState("7", (("7+0", "REQUEUED"), ("7+1", "REQUEUED")), live=False).final
    assert not JobState("7", (("7+0", "REQUEUED"), ("7+1", "REQUEUED")), live=True).final


def _launch(cluster, tmp_path, monkeypatch, sleep_s: int) -> HetJob:
    for k in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(k, cluster.env[k])
    monkeypatch.setenv("STUB_SLEEP", str(sleep_s))
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(STUB)
    stub.chmod(0o755)
    ex = HetJobExecutor(tmp_path / "run", python=str(stub))
    ex.update_parameters(config=TINY, overrides=["warm_start.enabled=false"])
    job = ex.launch()
    cluster.submitted.append(job.job_id)
    assert job.script.parent == tmp_path / "run" / "launch" and (tmp_path / "run" / "run.yaml").exists()
    return job


def _until(what, timeout: float, why: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.5)
    raise TimeoutError(why)


@pytest.mark.slurm
def test_both_components_tracked_requeued_and_cancelled(slurm_cluster, tmp_path, monkeypatch):
    job = _launch(slurm_cluster, tmp_path, monkeypatch, sleep_s=300)
    jid = job.job_id
    _until(lambda: all((tmp_path / "bin" / f"started.{r}").exists() for r in ("rollout-node", "trainer")), 120,
           f"the roles of job {jid} did not start: {job.stdout()}")
    js = job.job_state(force=True)
    assert js.components == ((f"{jid}+0", "RUNNING"), (f"{jid}+1", "RUNNING")), js
    assert job.state == "RUNNING" and job.components == js.components and not job.done(force_check=True)

    job.requeue()
    _until(lambda: job.job_state(force=True).state in ("PENDING", "REQUEUED"), 60,
           f"job {jid} not queued again after the requeue: {job.job_state(force=True).describe()}")
    assert not job.done(force_check=True)

    job.cancel()
    _until(lambda: job.done(force_check=True), 90, f"job {jid} still {job.job_state(force=True).describe()}")
    js = job.job_state()
    assert js.final and all(s in FINAL + ("REQUEUED",) for _, s in js.components), js
    assert isinstance(job.exception(), utils.FailedJobError)
    assert "restart 0" in job.stdout()


@pytest.mark.slurm
def test_a_job_that_completes_returns_its_state(slurm_cluster, tmp_path, monkeypatch):
    job = _launch(slurm_cluster, tmp_path, monkeypatch, sleep_s=1)
    js = job.result()
    assert js.state == "COMPLETED" and [s for _, s in js.components] == ["COMPLETED", "COMPLETED"], js
    assert "[neon-rl] done (exit 0)" in job.stdout()
    assert os.path.basename(job.log) == f"neon-rl-{job.job_id}.out"
