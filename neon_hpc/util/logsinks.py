"""Metrics where users look: TensorBoard event files and Weights & Biases, beside metrics.jsonl.

Every metric record a role writes goes through :meth:`neon_hpc.util.logs.RoleLogger.metrics`;
``metrics.jsonl`` stays the system of record (status, plots and the capacity planner read it), and the
sinks configured in the ``logging:`` section (``neon_hpc/config/logging.py``) receive the same record:

- ``logging.tensorboard: true``: one event-file folder per role and rank,
  ``RUN/logs/tb/<role>.<rank>/``, scalars named ``<role>/<key>`` (nested dicts flattened
  with ``/``), at the record's ``step`` (else the record's index). Open with
  ``tensorboard --logdir RUN/logs/tb``.
- ``logging.wandb: offline | online | off``: one W&B run per role and rank, named
  ``<role>-<rank>``, grouped by the run directory's name, with a stable id so that a resumed
  or requeued role continues its run. Offline runs are written under ``RUN/logs/wandb/`` and
  need no network (``wandb sync RUN/logs/wandb/offline-run-*`` uploads them later); online
  needs credentials (``WANDB_API_KEY`` or ``wandb login``), which ``neon-hpc config check``
  asks for.

Only finite numbers (and booleans, as 0/1) are sent; strings and events stay in
``metrics.jsonl``. A sink that fails to start stops the role with the reason: a configured
behaviour either happens or is refused. A role process enables the sinks once
(:func:`configure`), before it opens its loggers.
"""
from __future__ import annotations

import atexit
import hashlib
import math
from pathlib import Path
from typing import Any

# the config is a neon_hpc.config.logging.LoggingConfig, named only (util imports nothing of neon_hpc)
LoggingConfig = Any



class SinkError(RuntimeError):
    """A configured metrics sink cannot start; the message says which and why."""


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numeric leaves of a metric record, keys joined with ``/``."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(scalars(v, key + "/"))
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[key] = float(v)
    return out


# Not metrics: the record's bookkeeping fields.
_SKIP = {"time", "job", "role", "rank", "step"}


class TensorBoardSink:
    def __init__(self, run_root: Path, role: str, rank: int | str):
        try:
            # deferred: optional (tensorboard: the TensorBoard sink only)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SinkError(f"logging.tensorboard: true needs the tensorboard package ({e}); "
                            f"pip install 'neon-hpc[sinks]' (or run `bash env/setup.sh`)") from None
        self.dir = run_root / "logs" / "tb" / f"{role}.{rank}"
        self.writer = SummaryWriter(log_dir=str(self.dir), flush_secs=5)
        self.role = role
        self._closed = False
        atexit.register(self.close)   # roles may exit without closing their logger


    def write(self, record: dict[str, Any], step: int) -> None:
        wall = record.get("time")
        for k, v in scalars({k: v for k, v in record.items() if k not in _SKIP}).items():
            self.writer.add_scalar(f"{self.role}/{k}", v, global_step=step, walltime=wall)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()


class WandbSink:
    def __init__(self, cfg: LoggingConfig, run_root: Path, role: str, rank: int | str):
        try:
            import wandb  # deferred: optional (wandb: the W&B sink only)
        except ImportError as e:
            raise SinkError(f"logging.wandb: {cfg.wandb} needs the wandb package ({e}); "
                            f"pip install 'neon-hpc[sinks]' (or run `bash env/setup.sh`)") from None
        d = run_root / "logs" / "wandb"
        d.mkdir(parents=True, exist_ok=True)
        # stable per run directory, role and rank: a requeued role resumes the same W&B run
        run_id = hashlib.sha1(f"{run_root.resolve()}|{role}|{rank}".encode()).hexdigest()[:16]
        try:
            self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None, dir=str(d),
                                  mode=cfg.wandb, name=f"{role}-{rank}", group=run_root.name, job_type=role,
                                  id=run_id, resume="allow", settings=wandb.Settings(silent=True, console="off"))
        except Exception as e:  # wandb raises its own error types; the role must stop with the reason
            raise SinkError(f"logging.wandb: {cfg.wandb}: W&B did not start ({type(e).__name__}: {e})") from None
        self.role = role

    def write(self, record: dict[str, Any], step: int) -> None:
        values = scalars({k: v for k, v in record.items() if k not in _SKIP})
        if values:
            self.run.log({f"{self.role}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """The sinks of one RoleLogger: every metric record goes to each of them."""

    def __init__(self, sinks: list):
        self.sinks = sinks
        self.count = 0
        self.last_step = 0
        self.stepped = False

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            self.stepped = True
        else:
            # a role that never steps (workers, nodes): the record's index; after the first
            # stepped record, a record without a step (an event) stays at the current step
            step = self.last_step if self.stepped else self.count
        # W&B drops a record whose step goes backwards, so steps never decrease here
        step = max(step, self.last_step)
        self.last_step = step
        self.count += 1
        for s in self.sinks:
            s.write(record, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


_configured: LoggingConfig | None = None


def configure(cfg: LoggingConfig | None) -> None:
    """Enable the sinks of ``cfg`` for every RoleLogger this process opens from now on."""
    global _configured
    _configured = cfg


def open_sinks(run_root: Path, role: str, rank: int | str) -> Sinks | None:
    cfg = _configured
    if cfg is None or (not cfg.tensorboard and cfg.wandb == "off"):
        return None
    sinks: list = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_root, role, rank))
    if cfg.wandb != "off":
        sinks.append(WandbSink(cfg, run_root, role, rank))
    return Sinks(sinks)
