#!/usr/bin/env python
"""Print a trajectory shard's summary and one trajectory (same as `neon-hpc shard inspect`).

    python tools/inspect_shard.py RUN/trajectories/ready/<shard>.h5 [--index I] [--json]
"""
import sys

from neon_hpc.store.cli import main

if __name__ == "__main__":
    sys.exit(main(["inspect", *sys.argv[1:]]))
