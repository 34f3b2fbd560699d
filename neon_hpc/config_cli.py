"""``neon-hpc config check CONFIG [--set k=v ...]``: validate and print the resolved config."""
from __future__ import annotations

import argparse

from neon_hpc import config


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc config")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate a config and print it resolved")
    c.add_argument("config")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    cfg = config.load(a.config, a.set)
    print(config.dump(cfg), end="")
    return 0
