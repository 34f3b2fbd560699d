"""``neon-hpc``: thin entry point. Parse the subcommand, then hand the rest to the library.

Each subcommand lives in the component that owns it, as ``main(argv) -> int``; this file
only maps names to modules (imported lazily, so ``neon-hpc status`` never imports torch).
"""

from __future__ import annotations

import difflib
import importlib
import sys

from neon_hpc import envs  # the registry alone: reading the entries imports no environment
from neon_hpc.util import extras

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("neon_hpc.ops.run", "run the whole async loop as local processes (laptop, CI, one node)"),
    "sft": ("neon_hpc.launch.warm", "the main job's warm start alone: demonstrations + SFT (train.mode: sft)"),
    "demos": ("neon_hpc.launch.demos_cli", "write demonstration conversations (solver actions) as trajectory shards"),
    "launch": ("neon_hpc.launch.submit", "submit the heterogeneous Slurm job (rollout group + trainer group)"),
    "status": ("neon_hpc.ops.status", "one screen on a run: job, trainer step, weights, heartbeats, shards"),
    "tail": ("neon_hpc.ops.tail", "follow the per-role, per-rank logs of a run"),
    "plot": ("neon_hpc.ops.plot", "PNG of reward, staleness, throughput and idle fractions of a run"),
    "reshard": ("neon_hpc.reshard.cli", "Megatron torch_dist checkpoint -> HF safetensors (same as tools/reshard.py)"),
    "engine": ("neon_hpc.rollout.engines.cli",
               "embedded inference engine (SGLang /generate subset) and SGLang launch lines"),
    "shard": ("neon_hpc.store.cli", "inspect trajectory shards"),
    "env": ("neon_hpc.envs.cli", "the registered environments (config env.kind): `neon-hpc env list`"),
    "balance": ("neon_hpc.balance.cli", "balancing dry runs: sequence lengths in, one step's assignment out"),
    "costfit": ("neon_hpc.train.costfit.cli",
                "fit the balancer's cost model (balance.cost_file) to the trainer's timed step"),
    "plan": ("neon_hpc.plan.cli", "capacity planning: simulate the async system at cluster scale"),
    "config": ("neon_hpc.config_cli",
               "validate and print a resolved experiment config (check), or its JSON schema (schema)"),
}


def commands() -> dict[str, tuple[str, str]]:
    """The library's commands, then each installed environment's (its entry's ``cli``: ``neon-hpc xrd``)."""
    out = dict(COMMANDS)
    for e in envs.entries():
        if e.cli and e.name not in out:      # an environment cannot shadow a library command
            out[e.name] = (e.cli, e.cli_help or e.about)
    return out


def _usage() -> str:
    lines = ["usage: neon-hpc COMMAND [ARGS...]", "", "commands:"]
    for name, (_mod, desc) in commands().items():
        lines.append(f"  {name:<9} {desc}")
    lines.append("")
    lines.append("`neon-hpc COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    table = commands()
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        print(f"neon-hpc: unknown command {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
              file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module_name = table[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        fix = extras.hint(e)
        if fix:
            print(f"neon-hpc {name}: {fix}", file=sys.stderr)
            return 3
        if e.name and module_name.startswith(e.name):
            print(f"neon-hpc {name}: not built yet ({module_name} is missing in this checkout).", file=sys.stderr)
            return 3
        raise
    from neon_hpc.config import ConfigError  # deferred: heavy (neon_hpc.config: pydantic)
    try:
        return int(module.main(rest) or 0)
    except ModuleNotFoundError as e:
        fix = extras.hint(e)
        if fix is None:
            raise
        print(f"neon-hpc {name}: {fix}", file=sys.stderr)
        return 3
    except ConfigError as e:
        print(f"neon-hpc {name}: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
