"""A throwaway PostgreSQL cluster for tests: initdb in a temp dir, a free localhost port, stopped after.

Debian's server binaries (``apt-get install postgresql``, done by ``env/setup.sh``) live in
``/usr/lib/postgresql/<major>/bin``.  The server refuses to run as root, so under root it
runs as the ``postgres`` system user the package creates.  It listens on 127.0.0.1 only,
with ``trust`` authentication for the one user it creates: nothing else can reach it.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from neon_hpc.util.netutil import free_port


def server_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PgCluster:
    def __init__(self, user: str = "neon"):
        self.bin = server_bin()
        if self.bin is None:
            raise FileNotFoundError("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin; "
                                    "run `bash env/setup.sh` (installs Debian's postgresql)")
        self.user = user
        self.root = Path(tempfile.mkdtemp(prefix="neon-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.as_user, *args], capture_output=True, text=True, check=True, timeout=120)

    def start(self) -> "PgCluster":
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust",
                  "-E", "UTF8", "--no-sync")
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", opts, "-w", "-t", "60", "start")
        return self

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    def create_db(self, name: str) -> str:
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name)
        return self.dsn(name)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                            "-w", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)
