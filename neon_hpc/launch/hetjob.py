"""submitit's executor for a run's heterogeneous Slurm job (submitit plugin: entry point group
``submitit``, name ``executor``: ``submitit.core.plugins.get_executors()["hetjob"]``).

    ex = HetJobExecutor("runs/exp")                 # folder: the run directory
    ex.update_parameters(config="configs/exp.yaml", overrides=["train.steps=3"])
    job = ex.launch()                               # a submitit Job of both components
    job.components   # (("42+0", "RUNNING"), ("42+1", "RUNNING")): the rollout group, the trainer group
    job.state        # both folded into one word (``launch.slurmjob``); job.done(), job.wait()
    job.requeue()    # scontrol requeue: the job restarts and resumes from the run directory
    job.cancel()     # scancel: both components
    job.result()     # waits; the final JobState, or FailedJobError naming each component's state

``neon-hpc launch`` is this executor. The script is ``launch.slurm``'s rendering of the config
(its ``#SBATCH`` lines are the config's launch section), written into ``RUN/launch/`` and
submitted with ``sbatch`` from there, after ``RUN/run.yaml`` (the job and every requeue of it run
with the resolved config). What submitit cannot do for this job, and so this module does
itself, is in ``neon_hpc/launch/README.md`` ("submitit and the heterogeneous job").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time as _time
import typing as tp
from pathlib import Path

from submitit.core import core, logger, utils

from neon_hpc import config
from neon_hpc.launch.common import write_run_yaml
from neon_hpc.launch.lease import check_free
from neon_hpc.launch.slurm import OUTPUT, quote, render_sbatch, sbatch_command
from neon_hpc.launch.slurmjob import JobState, SlurmUnavailable, query
from neon_hpc.protocol.rundir import RunDir, atomic_write_text

_NOT_A_FUNCTION = ("HetJobExecutor submits the run's heterogeneous job, not a Python function: its two "
                   "groups run different programs (rollout nodes, trainer ranks) that meet in the run "
                   "directory, so there is nothing to pickle and no return value; call executor.launch()")


class LaunchRefused(RuntimeError):
    """The config cannot run as a Slurm job as it stands (the message names the fix)."""


class HetJobWatcher(core.InfoWatcher):
    """submitit's shared state poller, reading each job with ``slurmjob.query`` (every component,
    squeue while live, sacct after) instead of one ``sacct -j JOBID`` line, which a het job lacks."""

    def __init__(self, delay_s: int = 30) -> None:
        super().__init__(delay_s)
        self._states: dict[str, JobState] = {}

    def update(self) -> None:
        for job_id in self._registered - self._finished:
            self._num_calls += 1
            try:
                js = query(job_id)
            except SlurmUnavailable as e:
                logger.get_logger().warning(f"{e}; the state of job {job_id} may be out of date")
                continue
            self._states[job_id] = js
            self._info_dict[job_id] = {"State": js.state, "Components": js.describe()}
            if js.final:
                self._finished.add(job_id)
        self._last_status_check = _time.time()

    def job_state(self, job_id: str, mode: str = "standard") -> JobState:
        self.get_info(job_id, mode=mode)        # registers the job, polls when due (mode)
        return self._states.get(job_id, JobState(job_id, (), False))

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.job_state(job_id, mode).state

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        return self.job_state(job_id, mode).final

    def forget_final(self, job_id: str) -> None:
        """A requeued job runs again: poll it again."""
        self._finished.discard(job_id)
        self._last_status_check = float("-inf")


class HetJob(core.Job[JobState]):
    """A submitit Job of both components of the run's het job; folder: the directory it was
    submitted from (``RUN/launch/``, where the batch script's output is)."""

    _cancel_command = "scancel"         # the job id cancels every component
    watcher = HetJobWatcher()

    def __init__(self, folder: tp.Union[Path, str], job_id: str, tasks: tp.Sequence[int] = (0,)) -> None:
        super().__init__(folder, job_id, tasks)
        self.script: Path | None = None     # the rendered sbatch script (set by the executor)

    def job_state(self, force: bool = False) -> JobState:
        return self.watcher.job_state(self.job_id, "force" if force else "standard")

    @property
    def components(self) -> tuple[tuple[str, str], ...]:
        """``(("42+0", state), ("42+1", state))``: the rollout group, then the trainer group."""
        return self.job_state().components

    def done(self, force_check: bool = False) -> bool:
        return self.watcher.is_done(self.job_id, mode="force" if force_check else "standard")

    def requeue(self, check: bool = True) -> None:
        """``scontrol requeue``: Slurm stops both components and queues the job again; it resumes
        from the run directory (the batch script does this itself at a preemption)."""
        (subprocess.check_call if check else subprocess.call)(["scontrol", "requeue", self.job_id])
        self.watcher.forget_final(self.job_id)

    def results(self) -> list[JobState]:
        self.wait()
        js = self.job_state(force=True)
        if js.state != "COMPLETED":
            raise utils.FailedJobError(f"job {self.job_id} ended {js.describe()}; its batch script's output: "
                                       f"{self.log}; the roles' logs: RUN/logs/ (`neon-hpc tail RUN`)")
        return [js]

    def exception(self) -> tp.Optional[utils.FailedJobError]:    # type: ignore[override]
        try:
            self.results()
        except utils.FailedJobError as e:
            return e
        return None

    @property
    def log(self) -> Path:
        """The batch script's output (stdout and stderr in one file)."""
        return self.paths.folder / OUTPUT.replace("%j", self.job_id)

    def stdout(self) -> tp.Optional[str]:
        return self.log.read_text() if self.log.exists() else None

    def stderr(self) -> tp.Optional[str]:
        return None     # the script has no --error: its stderr is in stdout()


class HetJobExecutor(core.Executor):
    """Submits the run in ``folder`` (the run directory) as one heterogeneous job. Parameters:
    ``config`` (an experiment config path) and ``overrides`` (``KEY=VALUE`` strings, as
    ``--set``); the job's resources are the config's ``launch`` section. ``python``: the command
    the job runs Python with (default: this interpreter)."""

    job_class = HetJob

    def __init__(self, folder: tp.Union[str, Path], python: tp.Optional[str] = None) -> None:
        super().__init__(folder, {"config": None, "overrides": []})
        self.python = python or sys.executable

    @classmethod
    def _valid_parameters(cls) -> tp.Set[str]:
        return {"config", "overrides"}

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        unknown = sorted(set(kwargs) - self._valid_parameters())
        if unknown:
            raise ValueError(f"HetJobExecutor: unknown parameter(s) {unknown}: it takes config (an experiment "
                             f"config path) and overrides (KEY=VALUE strings, as --set); nodes, GPUs, time and "
                             f"partitions are the config's launch section (launch.rollout, launch.train, ...)")
        super()._internal_update_parameters(**kwargs)

    @classmethod
    def affinity(cls) -> int:
        # available where sbatch is, but never AutoExecutor's default: it runs only the RL job
        return -1 if shutil.which("sbatch") is None else 0

    def _internal_process_submissions(self, delayed_submissions: tp.List[utils.DelayedSubmission]
                                      ) -> tp.List[core.Job[tp.Any]]:
        raise NotImplementedError(_NOT_A_FUNCTION)

    def _config(self) -> config.ExperimentConfig:
        path = self.parameters["config"]
        if path is None:
            raise ValueError("HetJobExecutor: no config; executor.update_parameters(config='configs/<exp>.yaml')")
        return config.load(path, self.parameters["overrides"])

    def launch(self) -> HetJob:
        """Refuse what cannot run, write run.yaml, render the script into RUN/launch/, sbatch it.
        Raises ``LeaseHeld`` (another launch holds the run directory) or ``LaunchRefused``."""
        cfg, run_dir = self._config(), self.folder
        check_free(RunDir(run_dir))   # the job takes the lease itself when it starts
        if cfg.warm_start.enabled and not cfg.model.init_checkpoint:
            from neon_hpc.launch.warm import sft_checkpoint  # deferred: heavy (neon_hpc.launch.warm: httpx)
            raise LaunchRefused(
                f"warm_start.enabled: the Slurm job does not run the warm start (`neon-hpc run` does); run "
                f"`neon-hpc sft {self.parameters['config']} --run-dir {run_dir}` first and add --set "
                f"model.init_checkpoint={sft_checkpoint(cfg, run_dir)}, or --set warm_start.enabled=false")
        # run.yaml before sbatch: the job (and every requeue of it) runs with the resolved config,
        # overrides included
        run, cfg, diffs = write_run_yaml(cfg, str(run_dir))
        if diffs:
            print(f"neon-hpc launch: {run_dir} already has a run.yaml; it wins over the given config for "
                  f"{', '.join(diffs)}", file=sys.stderr)
        launch_dir = run_dir / "launch"
        launch_dir.mkdir(parents=True, exist_ok=True)
        script = launch_dir / f"neon_rl.{_time.strftime('%Y%m%d-%H%M%S')}.sbatch"
        atomic_write_text(script, render_sbatch(cfg, str(run.run_yaml)))
        cmd = sbatch_command(str(script), str(run.run_yaml.absolute()), str(run_dir))
        env = dict(os.environ, NEON_PYTHON=self.python)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=launch_dir)
        if r.returncode != 0:
            raise SystemExit(f"neon-hpc launch: sbatch failed ({r.stderr.strip()}); the script is {script}; "
                             f"command: {quote(cmd)}")
        job = HetJob(launch_dir, r.stdout.strip().split(";")[0])
        job.script = script
        return job
