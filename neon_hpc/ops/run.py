"""``neon-hpc run CONFIG [--run-dir DIR] [--set k=v ...] [--no-plot] [--quiet]``: the whole async
loop as local processes (``neon_hpc.launch.local``), then the run's plot (``neon_hpc.ops.plot``).

The launcher imports nothing of the operator tools (a layer above it): it returns how the run
ended, and this command draws ``RUN/plots/run.png`` after it.
"""

from __future__ import annotations

from neon_hpc.launch import local
from neon_hpc.ops.plot import plot_run


def main(argv: list[str]) -> int:
    ended = local.run(argv)
    if ended.plot is not None:
        ended.say(f"plot: {plot_run(str(ended.plot))}")
    return ended.rc
