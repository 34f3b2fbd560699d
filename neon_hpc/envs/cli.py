"""``neon-hpc env list``: the registered environments, one per line, name first."""
from __future__ import annotations

import argparse

from neon_hpc import envs
from neon_hpc.envs.base import RESUME_MODES


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc env", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the registered environments (config env.kind), one per line")
    p.parse_args(argv)
    for name in envs.kinds():
        entry = envs.REGISTRY[name]
        print(f"{name}  {entry.about} ({RESUME_MODES.get(entry.resume, entry.resume)})")
    return 0
