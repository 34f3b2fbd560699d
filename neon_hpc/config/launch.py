"""Launch section of the experiment config (owned by ``neon_hpc/launch``)."""
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from neon_hpc.util.constraints import Rule, above, at_least, between, section

_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpus(text: str) -> set[int]:
    """A Linux CPU list (``"1"``, ``"0-3"``, ``"0,2-3"``) as a set; ``""`` = no restriction (empty set)."""
    if not text:
        return set()
    if not _CPU_LIST.match(text):
        raise ValueError(f"not a CPU list: {text!r} (e.g. '1', '0-3', '0,2-3')")
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def split_cpus(cpus: list[int]) -> dict[str, str] | None:
    """``local_cpus`` lists for the two groups on disjoint CPUs (as on separate allocations): the
    trainer on the first of ``cpus``, the rollout on the rest; None with fewer than two."""
    if len(cpus) < 2:
        return None
    return {"train": str(cpus[0]), "rollout": ",".join(map(str, cpus[1:]))}


def trainer_threads(cpus: int, ranks: int, beside_rollout: bool) -> int:
    """Torch intra-op threads for each of ``ranks`` trainer processes launched locally on ``cpus``
    CPUs; ``beside_rollout``: the rollout node shares those CPUs (its engine computes on one).

    Torch otherwise starts one thread per CPU in every process: on the 2-core machine the
    trainer's two threads and the engine's one oversubscribe the cores, and under other load
    a trainer step's forward-backward took 1.01 s instead of 0.13 s (docs/results/2026-12-05-main-job.md); with
    one thread, 0.11 s under the same load. At least 1.
    """
    return max(1, (cpus - (1 if beside_rollout else 0)) // max(1, ranks))


def thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a child process ``threads`` OpenMP/torch threads, unless the
    operator's environment already sets ``OMP_NUM_THREADS`` (theirs wins)."""
    return {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(threads)}


@section
@dataclass
class GroupConfig:
    """One heterogeneous-job group (rollout or train)."""

    partition: str = ""
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem: str = ""                       # e.g. "0" for all, "8G"; "" = partition default
    # local backend only: the CPUs this group's processes run on (a Linux CPU list, "0", "1-3");
    # "" = any. Disjoint lists for rollout and train stand in for separate allocations on one
    # machine (tools/bench_learning.py: async overlaps what sync serialises only when the two
    # groups do not share cores). Slurm allocates its own.
    local_cpus: str = ""

    CHECKS = {
        "nodes": at_least(1),
        "tasks_per_node": at_least(1),
        "cpus_per_task": at_least(1),
    }
    RULES = (
        Rule("local_cpus", lambda c: not c.local_cpus or bool(_CPU_LIST.match(c.local_cpus)),
             "a Linux CPU list such as '1', '0-3' or '0,2-3' (or '' for any CPU)"),
    )


@section
@dataclass
class LaunchConfig:
    backend: Literal["local", "slurm"] = "local"
    job_name: str = "neon-rl"
    time_limit: str = "00:30:00"
    signal_before_s: int = 120          # --signal=USR1@<s>: checkpoint and requeue before the limit
    requeue: bool = True
    account: str = ""
    rollout: GroupConfig = field(default_factory=lambda: GroupConfig(partition="rollout"))
    train: GroupConfig = field(default_factory=lambda: GroupConfig(partition="train"))
    extra_sbatch: list[str] = field(default_factory=list)

    CHECKS = {"signal_before_s": at_least(0, "seconds before the time limit")}


@section
@dataclass
class WarmStartConfig:
    """``neon-hpc run``'s warm start (``launch/warm.py``): demonstrations, then SFT, then RL from it.

    With ``enabled``, the run directory's ``warm_start/`` holds the demonstrations
    (``neon-hpc demos``) and an SFT run of the same trainer (``train.mode: sft``); the RL run's
    ``model.init_checkpoint`` is that run's last checkpoint. A run directory that has it reuses it.
    """

    enabled: bool = False
    demos: int = 256                    # train-split tasks, one demonstration each
    imperfect: float = 0.3              # share of imperfect demonstrations (wrong minor phase, rough fraction)
    steps: int = 40                     # SFT optimizer steps
    trajectories_per_step: int = 16
    lr: float = 3e-3

    CHECKS = {
        "demos": at_least(1),
        "imperfect": between(0.0, 1.0),
        "steps": between(1, 10**9),
        "trajectories_per_step": at_least(1),
        "lr": above(0, le=1.0),
    }
