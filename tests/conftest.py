"""Shared fixtures: the real local Slurm cluster (started once per session if not already up)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from neon_hpc.launch.slurmjob import FINAL, query

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# The tiers (tests/README.md): a test module imports the helpers of tests/ (``repo_paths``,
# ``ranks``, ...) and, by bare name, other test modules (``from test_train_loop import start``),
# whichever tier folder either lives in. pytest's "prepend" import mode puts only the folder of
# each module it collects on sys.path, so every folder that holds tests goes there up front
# (test file names are unique across the tiers, as that import mode requires).
_tests = Path(__file__).resolve().parent
for _d in sorted({_tests} | {p.parent for p in _tests.rglob("test_*.py")}):
    if str(_d) not in sys.path:
        sys.path.insert(1, str(_d))


class Cluster:
    """Handle on the env/cluster.sh cluster: environment and small helpers for tests."""

    def __init__(self, root: Path, session_tmp: Path | None = None):
        self.root = root
        self.env = dict(os.environ, SLURM_CONF=str(root / "etc" / "slurm.conf"),
                        PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
        self.session_tmp = session_tmp   # jobs whose work dir is under it belong to this session
        self.submitted: list[str] = []

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True,
                              check=check, timeout=timeout)

    def sbatch(self, *args: str) -> str:
        job = self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]
        self.submitted.append(job)
        return job

    def state(self, job_id: str) -> str:
        """Job state (every component of a het job folded into one: ``launch.slurmjob``), from
        squeue while it is live and sacct after (poll: --wait can be late)."""
        return query(job_id, env=self.env).state

    def wait(self, job_id: str, timeout: float = 120) -> str:
        end = time.monotonic() + timeout
        st = "UNKNOWN"
        while time.monotonic() < end:
            st = self.state(job_id)
            if st in FINAL:
                return st
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {st} after {timeout}s")

    def sacct(self, job_id: str, expect: str, timeout: float = 30) -> str:
        """``sacct -X -P -o JobID,Partition,State`` once it contains ``expect``: slurmctld
        forwards records to slurmdbd asynchronously, so a fresh job can show empty fields."""
        end = time.monotonic() + timeout
        out = ""
        while time.monotonic() < end:
            out = self.run("sacct", "-n", "-X", "-P", "-o", "JobID,Partition,State", "-j", job_id).stdout
            if expect in out:
                return out
            time.sleep(0.5)
        return out

    def cancel_all(self) -> None:
        """Cancel this session's jobs: submitted here, or with a work dir under the session's tmp
        (``neon-hpc launch`` submits from RUN/launch). The cluster is shared: other sessions'
        jobs (``tools/chaos.py --backend slurm``, another engineer's tests) are left alone."""
        mine = set(self.submitted)
        if self.session_tmp is not None:
            out = self.run("squeue", "-h", "-o", "%i|%Z", check=False).stdout
            for line in out.splitlines():
                job, _, workdir = line.partition("|")
                if workdir.startswith(str(self.session_tmp)):
                    mine.add(job.strip().split("+")[0])    # a het component: its leader's id
        if mine:
            self.run("scancel", "--full", *sorted(mine), check=False)


def _cluster_up(env: dict) -> bool:
    if not Path(env["SLURM_CONF"]).exists():
        return False
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "mix", "alloc"))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if shutil.which("slurmctld") is None:
        pytest.skip("Slurm is not installed (run `bash env/setup.sh`)")
    root = Path(os.environ.get("NEON_CLUSTER_DIR", REPO / ".cluster"))
    cl = Cluster(root, tmp_path_factory.getbasetemp())
    started = False
    if not _cluster_up(cl.env):
        subprocess.run(["bash", str(REPO / "env" / "cluster.sh"), "start"], check=True,
                       env=dict(os.environ, NEON_CLUSTER_DIR=str(root)))
        started = True
    yield cl
    cl.cancel_all()
    if started and not os.environ.get("NEON_KEEP_CLUSTER"):
        subprocess.run(["bash", str(REPO / "env" / "cluster.sh"), "stop"],
                       env=dict(os.environ, NEON_CLUSTER_DIR=str(root)))


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (tests/pgcluster.py), stopped and removed after."""
    from pgcluster import PgCluster, server_bin
    if server_bin() is None:
        pytest.skip("PostgreSQL server not installed (run `bash env/setup.sh`, which installs Debian's postgresql)")
    pg = PgCluster().start()
    yield pg
    pg.stop()


# What a test's in-process trainer (``init_parallel``, ``train.loop.dist_env``, costfit's
# runner) writes into os.environ for its one-rank rendezvous must not reach the next test's
# subprocesses: a child that inherits MASTER_PORT meets at a port nobody serves any more.
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_rendezvous_leak():
    before = {k: os.environ.get(k) for k in _RENDEZVOUS_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
