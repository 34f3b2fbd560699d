"""env/cluster.sh start on a machine that already runs another checkout's cluster (issue 20).

A second cluster of its own (its own NEON_CLUSTER_DIR under tmp_path and its own
NEON_SLURM_PORT_BASE), never the shared one: a port that is taken is refused before anything
starts, naming the process that holds it and NEON_SLURM_PORT_BASE as the fix; a start that fails
half-way (slurmctld cannot bind, after MariaDB and slurmdbd came up) stops what it started, so
no MariaDB, slurmdbd or munged of it is left behind to break the next start the same way."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from neon_hpc.util.netutil import free_port
from repo_paths import REPO

pytestmark = pytest.mark.skipif(shutil.which("slurmctld") is None or shutil.which("mariadbd") is None,
                                reason="Slurm or MariaDB is not installed (run `bash env/setup.sh`)")


def _port_base() -> int:
    """A base whose cluster ports (BASE+6 .. BASE+204) are all free now."""
    for _ in range(50):
        base = free_port() // 100 * 100 - 300
        if all(_free(base + off) for off in (6, 17, 19, *range(201, 205))):
            return base
    pytest.skip("no free block of ports for a second cluster")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _processes_of(cluster: Path) -> list[str]:
    """Processes whose command line or environment names this cluster's directory."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            text = (p / "cmdline").read_bytes() + b"\0" + (p / "environ").read_bytes()
            comm = (p / "comm").read_text().strip()
        except OSError:
            continue
        if str(cluster).encode() in text and comm not in ("bash", "timeout", "python", "pytest"):
            out.append(f"{p.name} {comm}")
    return out


def _start(cluster: Path, base: int, **popen) -> subprocess.Popen:
    env = dict(os.environ, NEON_CLUSTER_DIR=str(cluster), NEON_SLURM_PORT_BASE=str(base))
    return subprocess.Popen(["bash", str(REPO / "env" / "cluster.sh"), "start"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def test_a_taken_port_is_refused_before_anything_starts_naming_its_owner_and_the_fix(tmp_path):
    base = _port_base()
    cluster = tmp_path / "cluster"
    holder = _listen(base + 19)            # slurmdbd's port, held by this test process
    try:
        p = _start(cluster, base)
        out, _ = p.communicate(timeout=60)
    finally:
        holder.close()
    assert p.returncode == 1, out
    assert f"port {base + 19} (slurmdbd = NEON_SLURM_PORT_BASE {base} + 19) is already taken by pid {os.getpid()}" \
        in out, out
    assert f"NEON_SLURM_PORT_BASE={base + 1000} bash env/cluster.sh start" in out, out
    assert "starting" not in out, f"nothing may start when a port is taken:\n{out}"
    assert not (cluster / "mysql" / "mysql").exists()
    assert _processes_of(cluster) == []


@pytest.mark.slow
def test_a_start_that_fails_half_way_stops_what_it_started(tmp_path):
    base = _port_base()
    cluster = tmp_path / "cluster"
    p = _start(cluster, base)
    # MariaDB and slurmdbd are up once slurmdbd's pid file exists; then slurmctld's port is taken
    # (after the start's port check ran): slurmctld dies on "Address already in use"
    end = time.monotonic() + 120
    while not (cluster / "run" / "slurmdbd.pid").exists():
        assert p.poll() is None and time.monotonic() < end, p.stdout.read() if p.poll() is not None else "timeout"
        time.sleep(0.1)
    holder = _listen(base + 17)
    started = _processes_of(cluster)
    munged = (cluster / "run" / "munged.ours").read_text().strip() if (cluster / "run" / "munged.ours").exists() else ""
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        holder.close()
    assert p.returncode == 1, out
    assert any("mariadbd" in s for s in started), started     # it had really begun
    assert "slurmctld exited while starting" in out or "slurmctld did not come up" in out, out
    assert "start failed: stopping what it started" in out, out
    assert _processes_of(cluster) == [], out
    if munged:      # the munged this start began (none was running) is gone too
        assert not Path(f"/proc/{munged}").exists() or Path(f"/proc/{munged}/comm").read_text().strip() != "munged"
    assert not list((cluster / "run").glob("*.pid")), list((cluster / "run").iterdir())
