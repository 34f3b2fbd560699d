"""What a trainer writes after a step, RL and SFT alike: published weights and checkpoints.

The rule, in one place: after step N, ``weights/v_N`` every ``train.publish_every`` steps and at
the last step; ``checkpoints/step_N`` every ``train.checkpoint_every`` steps (0: not by count), at
the first step ``train.checkpoint_every_s`` seconds after the last checkpoint or the loop's start
(0: not by time; rank 0's clock decides, :meth:`StepOutputs.time_due` joins the loop's one
all-reduce of the stop flag), at the last step, when a preemption stops the loop, and at every
publish of ``publish_via: reshard`` (it converts that checkpoint).  The direct path publishes
before the checkpoint, so engines get new weights without waiting for it.

Beside the steps where configured: the direct publish is a snapshot on the step and a write on
:class:`~neon_hpc.train.publish.BackgroundPublisher`'s thread; with ``train.checkpoint_async``
(the default) a checkpoint is a snapshot on the step and a write on
:class:`~neon_hpc.train.checkpoint.AsyncCheckpointer`'s thread, finalized at a later step
boundary (reshard waits for it: it converts the complete checkpoint).  The step's metrics get
what the step paid (``publish_s``, ``checkpoint_s``, ``checkpoint_snapshot_s``,
``checkpoint_wait_s``) and what finished beside it since (``publish_done_version``,
``publish_write_s``, ``publish_queued_s``, ``publish_superseded``, ``checkpoint_done_step``,
``checkpoint_write_s``, ``checkpoint_finalize_s`` on a step, ``checkpoint_seal_s`` beside one); each
finished write is one log line.
"""

from __future__ import annotations

import time
from typing import Any

from neon_hpc.protocol.rundir import RunDir
from neon_hpc.train import checkpoint as ckpt
from neon_hpc.train.publish import BackgroundPublisher, publish_weights
from neon_hpc.train.sections import TrainerSections
from neon_hpc.util.logs import RoleLogger


class StepOutputs:
    def __init__(self, run: RunDir, be, cfg: TrainerSections, log: RoleLogger, rank: int) -> None:
        self.run, self.be, self.cfg, self.log, self.rank = run, be, cfg, log, rank
        t = cfg.train
        self.publisher = BackgroundPublisher(run, cfg.model, rank) if t.publish_via == "direct" else None
        self.checkpointer = (ckpt.AsyncCheckpointer(run, be, log, t.checkpoint_write_timeout_s)
                             if t.checkpoint_async else None)
        self._checkpointed_at = time.monotonic()      # the loop's start, then each checkpoint's step

    def time_due(self) -> bool:
        """Rank 0: ``train.checkpoint_every_s`` has passed since the last checkpoint (or the start);
        other ranks say False (the loop takes the maximum over ranks, so rank 0's clock decides)."""
        every = self.cfg.train.checkpoint_every_s
        return self.rank == 0 and every > 0 and time.monotonic() - self._checkpointed_at >= every

    def poll(self) -> None:
        """Collective, at a step boundary or while waiting for data: finalize a checkpoint whose
        writes every rank has finished."""
        if self.checkpointer is not None:
            self.checkpointer.poll()

    def after_step(self, step: int, stop: bool, m: dict, state: dict[str, Any],
                   timed: bool = False) -> tuple[int | None, bool]:
        """Collective: what is due after ``step`` (``stop``: a preemption ends the loop here;
        ``timed``: :meth:`time_due` on some rank); ``state`` joins the checkpoint's state record.
        Adds to the metrics ``m``; returns the version published (or None) and whether a
        checkpoint was taken."""
        t = self.cfg.train
        reshard = t.publish_via == "reshard"
        publish_due = step % t.publish_every == 0 or step == t.steps
        counted = t.checkpoint_every > 0 and step % t.checkpoint_every == 0
        ckpt_due = counted or timed or step == t.steps or stop or (publish_due and reshard)
        published = None
        if self.publisher is not None and publish_due:
            m["publish_s"] = self.publisher.submit(self.be, step, step=step)   # the snapshot; the write beside
            published = step
        self.poll()                   # finalize the checkpoint in flight if every rank's writer is done
        if ckpt_due:
            c0 = time.perf_counter()
            full = {"version": step, "cursor": {"next_step": step + 1}, "published": step if publish_due else None,
                    **state}
            if self.checkpointer is not None:
                rec = self.checkpointer.submit(step, full)      # the snapshot; the write beside
                m["checkpoint_snapshot_s"], m["checkpoint_wait_s"] = rec.snapshot_s, rec.waited_s
                if publish_due and reshard:
                    self.checkpointer.wait()                   # reshard converts the complete checkpoint
            else:
                ckpt.save(self.run, self.be, step, full)
            m["checkpoint_s"] = time.perf_counter() - c0        # what the step paid
            self._checkpointed_at = time.monotonic()
        if self.checkpointer is not None:
            m.update(_checkpoint_metrics(self._log_checkpoints()))
        if publish_due and reshard:
            _, m["publish_s"], _ = publish_weights(self.run, self.be, self.cfg.model, step, step=step,
                                                   via="reshard", checkpoint_dir=self.run.checkpoint(step))
            published = step
        if self.publisher is not None:
            m.update(_publish_metrics(self._log_publishes()))
        return published, ckpt_due

    def close(self) -> None:
        """The last version written and the last checkpoint complete (call before the trainer exits)."""
        if self.publisher is not None:
            self.publisher.close()
            self._log_publishes()
        if self.checkpointer is not None:
            self.checkpointer.wait()
            self._log_checkpoints()

    def _log_checkpoints(self) -> list[dict]:
        """One log line (rank 0) per asynchronous checkpoint completed since the last call; their records."""
        out = []
        for r in self.checkpointer.completed():
            if self.rank == 0 and not r.error:
                self.log.info("checkpoint step_%d: snapshot %.3fs on the step (waited %.3fs for the previous one), "
                              "written in %.3fs beside the steps, finalized in %.3fs on a step, sealed in %.3fs "
                              "beside one", r.step, r.snapshot_s, r.waited_s, r.write_s, r.finalize_s, r.seal_s)
            out.append(r.as_dict())
        return out

    def _log_publishes(self) -> list[dict]:
        """One log line per background publish finished since the last call; their records."""
        out = []
        for r in self.publisher.completed():
            if r.superseded:
                self.log.info("publish v_%d superseded by a newer version after waiting %.2fs", r.version,
                              r.queued_s)
            elif r.error:
                self.log.error("publish v_%d failed: %s", r.version, r.error)
            else:
                self.log.info("published v_%d: snapshot %.3fs on the step, waited %.3fs, written in %.3fs beside "
                              "the steps%s", r.version, r.snapshot_s, r.queued_s, r.write_s,
                              "" if r.written else " (existed: kept)")
            out.append(r.as_dict())
        return out


def _publish_metrics(records: list[dict]) -> dict:
    """Scalars for the step's metrics record: the newest version written since the last step, what
    its write cost beside the steps, and how many waiting versions a newer one replaced."""
    out: dict = {"publish_superseded": sum(1 for r in records if r.get("superseded"))}
    written = [r for r in records if not r.get("superseded") and not r.get("error")]
    if written:
        r = written[-1]
        out.update(publish_done_version=r["version"], publish_write_s=r["write_s"], publish_queued_s=r["queued_s"])
    return out


def _checkpoint_metrics(records: list[dict]) -> dict:
    """Scalars for the step's metrics record: the newest checkpoint completed since the last step
    and what it cost beside the steps (its write, rank 0's seal) and at the boundary that finalized it."""
    done = [r for r in records if not r.get("error")]
    if not done:
        return {}
    r = done[-1]
    return {"checkpoint_done_step": r["step"], "checkpoint_write_s": r["write_s"],
            "checkpoint_finalize_s": r["finalize_s"], "checkpoint_seal_s": r["seal_s"]}
