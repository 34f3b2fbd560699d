"""One live launch per run directory (issue 20, fault 3): the lease in state/lease.json.

Real processes hold, race for and die with the lease; `neon-hpc run` and the sbatch script's
prepare step (what `neon-hpc launch` runs) refuse a directory another live launch holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neon_hpc.launch import lease
from neon_hpc.protocol.rundir import RunDir, atomic_write_json
from repo_paths import REPO

HOLDER = r"""
import sys, time
from neon_hpc.launch import lease
from neon_hpc.protocol.rundir import RunDir
run = RunDir(sys.argv[1])
rec = lease.acquire(run, "local")
r = lease.Renewer(run, rec.token, "holder"); r.start()
print(rec.token, flush=True)
time.sleep(300)
"""

RACER = r"""
import sys, time
from neon_hpc.launch import lease
from neon_hpc.protocol.rundir import RunDir
while time.time() < float(sys.argv[2]):
    pass
try:
    lease.acquire(RunDir(sys.argv[1]), "local")
    print("won", flush=True)
    time.sleep(float(sys.argv[2]) + 10 - time.time())    # stay alive while the others try
except lease.LeaseHeld:
    print("refused", flush=True)
"""


def _holder(run_dir: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def test_a_second_launch_is_refused_with_the_owner_named(tmp_path):
    p, token = _holder(tmp_path / "run")
    try:
        with pytest.raises(lease.LeaseHeld) as e:
            lease.acquire(RunDir(tmp_path / "run"), "local")
        assert f"launcher pid {p.pid}" in str(e.value) and token in str(e.value)
        assert f"still running here: pid {p.pid}" in str(e.value)
    finally:
        p.kill()
        p.wait()


def test_the_lease_of_a_killed_launch_is_taken_over_at_once(tmp_path):
    run = RunDir(tmp_path / "run")
    p, token = _holder(run.root)
    p.send_signal(signal.SIGKILL)
    p.wait()
    rec = lease.acquire(run, "local")
    assert rec.took_over["token"] == token and "none of its processes" in rec.took_over["why"]
    assert lease.read(run).token == rec.token
    assert not (run.state / "lease.d" / token).exists()       # the dead launch's members are swept


def test_racing_launches_get_exactly_one_lease(tmp_path):
    run = RunDir(tmp_path / "run")
    go = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(run.root), str(go)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=180)[0].strip() for p in procs]
    assert sorted(outs) == ["refused"] * 5 + ["won"], outs


def test_racing_takeovers_of_a_dead_lease_get_exactly_one(tmp_path):
    run = RunDir(tmp_path / "run")
    p, _ = _holder(run.root)
    p.kill()
    p.wait()
    go = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(run.root), str(go)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=180)[0].strip() for p in procs]
    assert sorted(outs) == ["refused"] * 5 + ["won"], outs
    assert lease.read(run).gen == 1


def test_a_lease_on_another_host_counts_as_dead_only_after_its_ttl(tmp_path):
    run = RunDir(tmp_path / "run").create()
    rec = {"token": "elsewhere-1", "host": "some-other-node", "pid": 1, "backend": "local", "job_id": "local",
           "renewed": time.time(), "ttl_s": 30.0, "gen": 0}
    atomic_write_json(lease.lease_path(run), rec)
    with pytest.raises(lease.LeaseHeld, match="some-other-node"):
        lease.acquire(run, "local")
    atomic_write_json(lease.lease_path(run), dict(rec, renewed=time.time() - 31))
    assert "not renewed for" in lease.acquire(run, "local").took_over["why"]


def test_a_requeued_slurm_job_takes_over_its_own_earlier_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))   # no squeue: the restart count alone must decide
    run = RunDir(tmp_path / "run").create()
    atomic_write_json(lease.lease_path(run), {"token": "slurm-77-0", "host": "n1", "pid": 1, "backend": "slurm",
                                              "job_id": "77", "restart": 0, "renewed": time.time(), "gen": 0})
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(run, "slurm", job_id="78", token="slurm-78-0")
    rec = lease.acquire(run, "slurm", job_id="77", restart=1, token="slurm-77-1")
    assert "restart 1 of the same Slurm job 77" in rec.took_over["why"]


def test_a_renewer_that_lost_its_lease_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_S", 0.05)
    run = RunDir(tmp_path / "run")
    rec = lease.acquire(run, "local")
    lost = []
    r = lease.Renewer(run, rec.token, "test", on_lost=lost.append)
    r.start()
    # wait for the first renewal (a fixed 0.3 s sleep missed it on a loaded machine: flaky)
    deadline = time.monotonic() + 30
    while not (lease.read(run).renewed_by or "").startswith("test@") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.read(run).renewed_by.startswith("test@")
    # another launch takes the lease. This test writes the record directly, so a renewal already between
    # its read and its write can put our token back (a real takeover waits for the TTL to expire first):
    # write again until the renewer reads the new holder
    deadline = time.monotonic() + 30
    while not lost and time.monotonic() < deadline:
        atomic_write_json(lease.lease_path(run), dict(lease.read(run).to_json(), token="someone-else"))
        r.join(timeout=0.5)
    r.join(timeout=5)
    assert lost and "someone-else" in lost[0]
    assert not r.is_alive()


def test_neon_hpc_run_and_the_sbatch_prepare_refuse_a_held_run_dir(tmp_path):
    p, token = _holder(tmp_path / "run")
    try:
        r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "run", "--run-dir", str(tmp_path / "run"),
                            "--quiet", "--no-plot"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 3, r.stderr[-2000:]
        assert f"launcher pid {p.pid}" in r.stderr and "one launch at a time" in r.stderr
        assert not (tmp_path / "run" / "logs" / "trainer").exists()      # nothing was started
        r = subprocess.run([sys.executable, "-m", "neon_hpc.launch.common", "--config",
                            str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(tmp_path / "run"),
                            "--job-id", "99"], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, NEON_LEASE_TOKEN="slurm-99-0"))
        assert r.returncode == 3 and token in r.stderr, r.stderr[-2000:]
        r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "launch", str(REPO / "configs" / "tiny_cpu.yaml"),
                            "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 3 and token in r.stderr, r.stderr[-2000:]     # refused before sbatch
        assert not (tmp_path / "run" / "launch").exists()
        assert json.loads((tmp_path / "run" / "state" / "lease.json").read_text())["token"] == token
    finally:
        p.kill()
        p.wait()
