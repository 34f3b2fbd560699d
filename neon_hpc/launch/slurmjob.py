"""Slurm's view of one job: the only code that asks ``squeue`` and ``sacct`` about a job's state.

submitit's view of the run's job (``launch.hetjob``: its Job's watcher, so ``neon-hpc launch
--wait``), ``neon-hpc status`` and the tests' cluster fixture all call :func:`query`.  A heterogeneous job
has one record per component (``JOBID+0``, ``JOBID+1``, ...): every one of them is read, from ``squeue`` while
any is live and from ``sacct`` once none is.  :attr:`JobState.state` folds them into one word:

- live: ``RUNNING`` if any component runs, else the first component's state (``PENDING``);
- ended: ``COMPLETED`` only if every component completed, else the first component state
  that is final (``FAILED``, ``CANCELLED``, ...), else the first that is not ``COMPLETED``;
  ``UNKNOWN`` when Slurm has no record (yet: slurmctld hands records to slurmdbd
  asynchronously, so poll).

:attr:`JobState.final`: the job will not run again by itself. A component that sacct still
lists as ``REQUEUED`` while squeue lists nothing of the job has ended too: a job cancelled
after a requeue can keep that record, and a job squeue no longer lists is not coming back.

:func:`in_queue` is the lease's question (is the job still in the queue at all?), with
Slurm's answer kept apart from no answer.

A state is its first word (``CANCELLED by 0`` -> ``CANCELLED``).  Slurm not reachable (no
``squeue`` on the PATH, a command that hangs past ``timeout``) raises :class:`SlurmUnavailable`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

# states after which a job does not run again by itself
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


class SlurmUnavailable(RuntimeError):
    """squeue/sacct could not be run or did not answer."""


@dataclass(frozen=True)
class JobState:
    job_id: str
    components: tuple[tuple[str, str], ...]   # (JobID as Slurm prints it: "7" or "7+1", state)
    live: bool            # from squeue (which also shows a job that just ended) or from sacct

    @property
    def state(self) -> str:
        states = [s for _, s in self.components]
        if not states:
            return "UNKNOWN"
        if self.live:
            return "RUNNING" if "RUNNING" in states else states[0]
        bad = [s for s in states if s != "COMPLETED"]
        ended = [s for s in bad if s in FINAL]
        return (ended or bad or ["COMPLETED"])[0]

    @property
    def final(self) -> bool:
        if self.state in FINAL:
            return True
        gone = ("REQUEUED",) + FINAL     # out of squeue: a REQUEUED record is a requeue that was cancelled
        return not self.live and bool(self.components) and all(s in gone for _, s in self.components)

    def describe(self) -> str:
        """``RUNNING`` for one component; ``FAILED (7+0 COMPLETED, 7+1 FAILED)`` for several."""
        if len(self.components) <= 1:
            return self.state
        return f"{self.state} ({', '.join(f'{i} {s}' for i, s in self.components)})"


def _rows(text: str) -> tuple[tuple[str, str], ...]:
    rows = []
    for line in text.splitlines():
        if "|" not in line:
            continue
        job, state = line.split("|", 1)
        word = state.split()[0].rstrip("+") if state.split() else ""
        if word:
            rows.append((job.strip(), word))
    return tuple(rows)


def query(job_id: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> JobState:
    """Every component's state of job ``job_id`` (module docstring)."""
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout).stdout
        except (OSError, subprocess.SubprocessError) as e:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed ({e}): is Slurm reachable from here "
                                   f"(SLURM_CONF, PATH)?") from None

    live = _rows(run(["squeue", "-h", "-j", str(job_id), "-o", "%i|%T"]))
    if live:
        return JobState(str(job_id), live, True)
    return JobState(str(job_id), _rows(run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State"])),
                    False)


def in_queue(job_id: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> str | None:
    """Whether ``squeue`` still lists job ``job_id``: ``"listed"``, ``"gone"`` (it lists
    nothing), ``"unknown"`` (Slurm no longer knows the id), or None when Slurm did not
    answer (no word either way: the lease then takes nothing over on Slurm's account)."""
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                           env=env, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode == 0:
        return "listed" if r.stdout.strip() else "gone"
    if "Invalid job id" in r.stderr:
        return "unknown"
    return None
