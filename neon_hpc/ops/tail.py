"""``neon-hpc tail RUN --role R [--rank N] [-n LINES] [-f]``: the per-role logs of a run.

Without ``--rank`` all ranks of the role are shown, each line prefixed with its rank; with
``-f`` new lines are followed (polling, so it works on NFS/Lustre where inotify does not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import last_lines


def log_files(run: RunDir, role: str, rank: str | None) -> list[Path]:
    d = run.log_dir(role)
    if not d.is_dir():
        roles = sorted(p.name for p in run.logs.iterdir() if p.is_dir()) if run.logs.is_dir() else []
        raise SystemExit(f"neon-hpc tail: no logs for role {role!r} in {run.logs}; roles with logs: "
                         f"{', '.join(roles) or 'none yet'}")
    files = sorted(d.glob("*.log"), key=lambda p: (len(p.stem), p.stem))
    if rank is not None:
        files = [p for p in files if p.stem == str(rank)]
        if not files:
            raise SystemExit(f"neon-hpc tail: no log for {role} rank {rank} in {d}")
    return files


def tail(run_dir: str, role: str, rank: str | None = None, n: int = 20, follow: bool = False,
         out=sys.stdout, poll_s: float = 0.5, max_s: float | None = None) -> int:
    run = RunDir(run_dir)
    files = log_files(run, role, rank)
    prefix = len(files) > 1
    offsets = {}
    for p in files:
        for line in last_lines(p, n):
            out.write((f"[{p.stem}] " if prefix else "") + line + "\n")
        offsets[p] = p.stat().st_size
    out.flush()
    start = time.monotonic()
    partial: dict[Path, str] = {}
    while follow and (max_s is None or time.monotonic() - start < max_s):
        time.sleep(poll_s)
        for p in log_files(run, role, rank):  # new ranks may appear
            prefix = prefix or p not in offsets
            off = offsets.get(p, 0)
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                continue
            if size < off:  # truncated / rotated: start over
                off = 0
            if size > off:
                with open(p, "rb") as f:
                    f.seek(off)
                    chunk = partial.pop(p, "") + f.read(size - off).decode(errors="replace")
                *complete, rest = chunk.split("\n")
                if rest:
                    partial[p] = rest  # a line still being written: wait for its newline
                for line in complete:
                    out.write((f"[{p.stem}] " if prefix else "") + line + "\n")
                out.flush()
            offsets[p] = size
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc tail", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--role", required=True, help="rollout, trainer, engine, launcher, ...")
    p.add_argument("--rank", default=None)
    p.add_argument("-n", "--lines", type=int, default=20)
    p.add_argument("-f", "--follow", action="store_true")
    a = p.parse_args(argv)
    try:
        return tail(a.run_dir, a.role, a.rank, a.lines, a.follow)
    except KeyboardInterrupt:
        return 0
