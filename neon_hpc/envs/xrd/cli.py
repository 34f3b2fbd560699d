"""``neon-hpc xrd ...``: the XRD plugin's command.

``neon-hpc xrd eval --endpoint URL ...`` (an LLM agent through the agent loop) is this
plugin's :mod:`~neon_hpc.envs.xrd.eval_cli`; every other subcommand (library, tasks, the
baseline solver's evaluation) is the XRD package's own :mod:`neon_hpc.envs.xrd.science.cli`, which imports
nothing of the rollout.
"""
from __future__ import annotations

import importlib
import sys

from neon_hpc.envs.xrd.science import cli as xrd_cli


def is_agent_eval(argv: list[str]) -> bool:
    """``eval`` with ``--endpoint``: the LLM agent evaluation."""
    return argv[:1] == ["eval"] and any(a == "--endpoint" or a.startswith("--endpoint=") for a in argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if is_agent_eval(argv):
        # the agent loop, the engine client, the tokenizer: imported when used
        return importlib.import_module("neon_hpc.envs.xrd.eval_cli").main(argv[1:])
    return xrd_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
