"""The local Slurm cluster from env/cluster.sh is a real one: partitions, multi-node srun,
heterogeneous jobs, accounting, submitit and MPI all work on it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def test_sbatch_to_each_partition_and_sacct(slurm_cluster, tmp_path):
    ids = {}
    for part in ("rollout", "train"):
        ids[part] = slurm_cluster.sbatch("-p", part, "-o", str(tmp_path / f"{part}_%j.out"),
                                         "--wrap", "echo partition=$SLURM_JOB_PARTITION node=$SLURMD_NODENAME")
    for part, jid in ids.items():
        assert slurm_cluster.wait(jid) == "COMPLETED"
        out = (tmp_path / f"{part}_{jid}.out").read_text()
        assert f"partition={part}" in out
    for part, jid in ids.items():
        assert f"{jid}|{part}|COMPLETED" in slurm_cluster.sacct(jid, f"{jid}|{part}|COMPLETED")


def test_two_node_srun(slurm_cluster, tmp_path):
    jid = slurm_cluster.sbatch("-p", "rollout", "-N", "2", "-o", str(tmp_path / "out_%j"),
                               "--wrap", "srun -N2 -n2 bash -c 'echo task=$SLURM_PROCID node=$SLURMD_NODENAME'")
    assert slurm_cluster.wait(jid) == "COMPLETED"
    lines = sorted((tmp_path / f"out_{jid}").read_text().split())
    nodes = {l.split("=")[1] for l in lines if l.startswith("node=")}
    assert len(nodes) == 2, lines


def test_heterogeneous_job(slurm_cluster, tmp_path):
    script = tmp_path / "het.sbatch"
    script.write_text(textwrap.dedent("""\
        #!/bin/bash
        #SBATCH -p rollout -N1 -n1
        #SBATCH hetjob
        #SBATCH -p train -N1 -n1
        srun --het-group=0,1 bash -c 'echo group=$SLURM_HET_SIZE procid=$SLURM_PROCID node=$SLURMD_NODENAME'
        """))
    jid = slurm_cluster.sbatch("-o", str(tmp_path / "het_%j.out"), str(script))
    assert slurm_cluster.wait(jid) == "COMPLETED"
    out = (tmp_path / f"het_{jid}.out").read_text()
    assert "procid=0" in out and "procid=1" in out
    acct = slurm_cluster.sacct(jid, f"{jid}+1|train|COMPLETED")
    assert f"{jid}+0|rollout|COMPLETED" in acct and f"{jid}+1|train|COMPLETED" in acct


def test_mpi_under_srun_pmi2(slurm_cluster, tmp_path):
    prog = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('rank', c.rank, 'of', c.size, flush=True)"
    jid = slurm_cluster.sbatch("-p", "all", "-N", "2", "-n", "2", "-o", str(tmp_path / "mpi_%j"),
                               "--wrap", f"srun --mpi=pmi2 {sys.executable} -c \"{prog}\"")
    assert slurm_cluster.wait(jid) == "COMPLETED"
    out = (tmp_path / f"mpi_{jid}").read_text()
    assert "rank 0 of 2" in out and "rank 1 of 2" in out, out


@pytest.mark.mpi
def test_mpi_under_mpiexec(tmp_path):
    import subprocess
    mpiexec = Path(sys.executable).parent / "mpiexec"
    # each rank writes its own file: two ranks sharing one stdout pipe may interleave
    prog = ("import sys; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "open(f'{sys.argv[1]}/rank{c.rank}', 'w').write(f'{c.allreduce(c.rank + 1)} {c.size}')")
    r = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-c", prog, str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [(tmp_path / f"rank{i}").read_text() for i in range(2)] == ["3 2", "3 2"]


def test_submitit_autoexecutor(slurm_cluster, tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    for k, v in slurm_cluster.env.items():
        if k in ("SLURM_CONF", "PATH"):
            monkeypatch.setenv(k, v)
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(slurm_partition="train", timeout_min=5, slurm_additional_parameters={"wait-all-nodes": 0})
    import math  # a function the job can import by name (test modules are not on its path)
    job = ex.submit(math.factorial, 6)
    assert job.result() == 720
    assert slurm_cluster.wait(job.job_id) == "COMPLETED"
