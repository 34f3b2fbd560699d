"""Render the heterogeneous Slurm job of a run from its config.

Group 0 (rollout): one ``rollout-node`` task per node (engines + supervised workers).
Group 1 (train): the trainer ranks, one task per GPU. Both groups are one job, so they
start together, end together, and are accounted together; they meet in the run directory.

The text that reaches Slurm is reviewed like code: ``sbatch/tiny_cpu.example.sbatch`` is this
renderer's output for ``configs/tiny_cpu.yaml`` and a test keeps the two identical. It is an
example, not an entry point: its ``#SBATCH`` lines are that config's launch section, so every
config gets its own script (``neon-hpc launch CONFIG`` renders and submits it through
``launch.hetjob``; ``--render`` prints it).

Signals and requeue: ``--signal=USR1@<s>`` makes Slurm send SIGUSR1 to every job step
``<s>`` seconds before the time limit; the trainer checkpoints and exits 0 leaving the
preemption marker (``neon_hpc.protocol``), the rollout side flushes, and the script requeues the job
(``--requeue``), which resumes from the run directory alone. A failed step fails the job
(``--kill-on-bad-exit``); the script waits for whichever group ends first and stops the
other, so nothing keeps running after the job.
"""

from __future__ import annotations

import shlex

from neon_hpc.config import ExperimentConfig
from neon_hpc.config.launch import GroupConfig
from neon_hpc.util.rankenv import MASTER_PORT_BASH

# the batch script's own output, in the directory it is submitted from (%j: the job id)
OUTPUT = "neon-rl-%j.out"

_BODY = r'''
set -uo pipefail
CONFIG="${1:-%(config)s}"
RUN_DIR="${2:-%(run_dir)s}"
PY="${NEON_PYTHON:-python3}"
export PYTHONUNBUFFERED=1
echo "[neon-rl] job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on $(hostname):" \
  "config ${CONFIG}, run dir ${RUN_DIR}"

# one live launch per run directory: this job (this restart of it) takes the lease first, or
# exits 3 naming the launch that holds it; every task renews it (neon_hpc/launch/lease.py)
export NEON_LEASE_TOKEN="slurm-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
# the run's config is written once (a requeued job resumes with it); the job record names this job
"$PY" -m neon_hpc.launch.common --config "$CONFIG" --run-dir "$RUN_DIR" \
  --backend slurm --job-id "$SLURM_JOB_ID" || exit $?
# the run directory's names are the protocol's (neon_hpc/protocol/README.md): asked, never spelled here
proto() { "$PY" -m neon_hpc.protocol "$@" "$RUN_DIR"; }
RUN_YAML="$(proto path run-yaml)"

# torch.distributed rendezvous on the first node of the trainer group, by its NodeAddr
# (the node name need not resolve: emulated nodes, clusters with a separate fabric name)
MASTER_NODE="$(scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_1}" | head -n 1)"
export MASTER_ADDR="$(scontrol show node "$MASTER_NODE" -o | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')"
export MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"
export MASTER_PORT="%(master_port)s"

srun --het-group=0 --kill-on-bad-exit=1 --mpi=pmi2 \
  "$PY" -m neon_hpc.launch.roles rollout-node --config "$RUN_YAML" --run-dir "$RUN_DIR" &
ROLLOUT=$!
srun --het-group=1 --kill-on-bad-exit=1 --mpi=pmi2 \
  "$PY" -m neon_hpc.launch.roles trainer --config "$RUN_YAML" --run-dir "$RUN_DIR" &
TRAINER=$!

# Polled, not plain `wait`: a trapped signal interrupts wait and would look like an exit code.
# `reap PID SECONDS` (the signal path): SIGKILL it if it still runs after SECONDS.
reap() {
  local n=0
  while kill -0 "$1" 2>/dev/null; do
    sleep 1; n=$((n + 1))
    if [ -n "${2:-}" ] && [ "$n" -eq "$2" ]; then
      echo "[neon-rl] pid $1 still running ${2}s after the stop signal; killing it"; kill -KILL "$1" 2>/dev/null
    fi
  done
  wait "$1"
}
release_lease() { "$PY" -m neon_hpc.launch.lease release "$RUN_DIR" || true; }

stop_all() {
  kill -TERM "$TRAINER" "$ROLLOUT" 2>/dev/null; reap "$TRAINER" 180; reap "$ROLLOUT" 60; release_lease; exit 143
}
trap stop_all TERM INT
# SIGUSR1 is for the steps (trainer checkpoints, workers flush); if it reaches this shell too
# (scancel -s USR1 --batch, or --signal=B:USR1), it must not kill the job before they are done
trap 'echo "[neon-rl] SIGUSR1: the trainer checkpoints, the rollout side flushes"' USR1


# whichever group ends first decides; the other is stopped (SIGTERM: flush / checkpoint)
while kill -0 "$TRAINER" 2>/dev/null && kill -0 "$ROLLOUT" 2>/dev/null; do sleep 1; done
if ! kill -0 "$TRAINER" 2>/dev/null; then
  reap "$TRAINER"; RC=$?
  if [ "$RC" -eq 0 ] && ! proto preempted; then
    # all steps done: the rollout nodes see the finished marker and stop their workers and
    # engines themselves; signalling srun instead would make Slurm kill the step's tasks outright
    proto finish
    for _ in $(seq 60); do kill -0 "$ROLLOUT" 2>/dev/null || break; sleep 1; done
  fi
  kill -TERM "$ROLLOUT" 2>/dev/null; reap "$ROLLOUT" 60
else
  reap "$ROLLOUT"; RC=$?
  if [ "$RC" -eq 0 ]; then
    # a clean stop (SIGUSR1/SIGTERM): the trainer is checkpointing too; let it finish
    reap "$TRAINER"; RC=$?
  else
    echo "[neon-rl] rollout group failed (exit ${RC}); stopping the trainer (it checkpoints first)"
    kill -TERM "$TRAINER" 2>/dev/null; reap "$TRAINER" 180
    # a failure is not a preemption: no requeue loop; rerunning the job resumes from the checkpoint
    proto clear-preempted
  fi
fi

if proto preempted; then
  echo "[neon-rl] trainer checkpointed before the time limit; requeueing job ${SLURM_JOB_ID}"
  release_lease
  scontrol requeue "${SLURM_JOB_ID}"
  exit 0
fi
if [ "$RC" -eq 0 ]; then
  proto finish
fi
release_lease
echo "[neon-rl] done (exit ${RC})"
exit "$RC"
'''


def _group_lines(g: GroupConfig) -> list[str]:
    lines = []
    if g.partition:
        lines.append(f"--partition={g.partition}")
    lines += [f"--nodes={g.nodes}", f"--ntasks-per-node={g.tasks_per_node}", f"--cpus-per-task={g.cpus_per_task}"]
    if g.gpus_per_node:
        lines.append(f"--gpus-per-node={g.gpus_per_node}")
    if g.mem:
        lines.append(f"--mem={g.mem}")
    return lines


def render_sbatch(cfg: ExperimentConfig, config_path: str) -> str:
    """The sbatch script for ``cfg`` (config_path and cfg.run_dir are its default arguments)."""
    L = cfg.launch
    head = ["#!/bin/bash",
            f"# neon-hpc heterogeneous RL job, rendered from {config_path} by `neon-hpc launch --render`.",
            f"# Its #SBATCH lines are {config_path}'s launch section: another config needs its own script",
            "# (`neon-hpc launch OTHER.yaml` renders and submits it; `--render` prints it).",
            "# Usage: sbatch THIS_SCRIPT [CONFIG] [RUN_DIR]   (NEON_PYTHON: the venv's python)",
            "# Group 0: rollout nodes (engines + rollout workers). Group 1: trainer ranks.",
            f"#SBATCH --job-name={L.job_name}",
            f"#SBATCH --time={L.time_limit}",
            f"#SBATCH --signal=USR1@{L.signal_before_s}",
            f"#SBATCH --output={OUTPUT}",
            "#SBATCH --open-mode=append"]
    head.append("#SBATCH --requeue" if L.requeue else "#SBATCH --no-requeue")
    if L.account:
        head.append(f"#SBATCH --account={L.account}")
    head += [f"#SBATCH {x}" for x in L.extra_sbatch]
    head += [f"#SBATCH {x}" for x in _group_lines(L.rollout)]
    head.append("#SBATCH hetjob")
    head += [f"#SBATCH {x}" for x in _group_lines(L.train)]
    body = _BODY % {"config": config_path, "run_dir": cfg.run_dir, "master_port": MASTER_PORT_BASH}
    return "\n".join(head) + "\n" + body


def sbatch_command(script: str, config_path: str, run_dir: str) -> list[str]:
    return ["sbatch", "--parsable", script, config_path, run_dir]


def quote(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
