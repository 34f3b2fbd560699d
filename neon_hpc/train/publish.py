"""Publishing trainer weights for the engines: ``weights/v_N`` (HF safetensors), then ``LATEST``.

The one place that turns the trainer's state into engine weights (``train.publish_via``):

- ``direct`` (default): gather the full megatron state dict on rank 0
  (:func:`neon_hpc.train.backend.full_state_dict`), convert with
  ``neon_hpc.models.convert.megatron_to_hf``, write with ``neon_hpc.models.hf.save_hf`` (staged
  and renamed into place).  Fine for small models.
- ``reshard``: the loop checkpoints first, then rank 0 converts that torch_dist checkpoint
  with ``neon_hpc.reshard.convert`` (chunk by chunk, streamed; also staged and renamed).

Either way ``weights/LATEST`` is written last.

Off the step (:class:`BackgroundPublisher`, the loop's direct path): the step pays only for
the snapshot (the gather of the bf16 weights to host memory, a collective every rank takes
part in); the conversion and the safetensors write run on a writer thread of rank 0 beside
the next steps, staged and renamed into place as above, ``LATEST`` after, so engines see
``v_N`` only when it is complete.  One publish is written at a time and at most one waits:
a newer snapshot replaces a waiting one (that version is never written: engines skip to the
newer weights), so a write slower than the steps never stacks up.  What each version cost
(snapshot, wait, write) is kept per version and logged by the loop.

Published directories are immutable: if ``v_N`` already exists (a step re-run after a crash
between publish and checkpoint), it is kept and only ``LATEST`` is refreshed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from neon_hpc.config.model import ModelConfig
from neon_hpc.models.convert import megatron_to_hf
from neon_hpc.models.hf import hf_config, save_hf
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.reshard.pipeline import convert
from neon_hpc.train.backend import Backend, full_state_dict


def publish_weights(run: RunDir, be: Backend, model_cfg: ModelConfig, version: int,
                    step: int | None = None, via: str = "direct",
                    checkpoint_dir: Path | None = None) -> tuple[Path, float, bool]:
    """Collective: publish this backend's weights as ``weights/v_{version}``, then ``LATEST``.

    ``via="direct"``: gather and convert in memory (small models).  ``via="reshard"``: convert
    ``checkpoint_dir`` (the torch_dist checkpoint of these very weights) with
    ``neon_hpc.reshard.convert`` on rank 0, chunk by chunk and streamed, never holding
    the whole model.  Returns ``(path, seconds, written)``; ``written`` is False when
    ``v_{version}`` existed.
    """
    t0 = time.perf_counter()
    final = run.weights_version(version)
    if via == "direct":
        written = _direct(run, be, model_cfg, final)
    elif via == "reshard":
        if checkpoint_dir is None:
            raise ValueError("publish via reshard needs the checkpoint of the weights to publish")
        written = _reshard(be, model_cfg, Path(checkpoint_dir), final)
    else:
        raise ValueError(f"train.publish_via must be 'direct' or 'reshard', got {via!r}")
    if be.layout.rank == 0:
        latest = run.latest_weights()
        if latest is None or latest[0] <= version:
            run.publish_latest(version, step=step if step is not None else version)
    return final, time.perf_counter() - t0, written


def _direct(run: RunDir, be: Backend, model_cfg: ModelConfig, final: Path) -> bool:
    full = full_state_dict(be)          # every rank takes part; rank 0 gets the result
    if be.layout.rank != 0 or final.exists():
        return False
    save_hf(megatron_to_hf(full, model_cfg), model_cfg, final)
    return True


def _reshard(be: Backend, model_cfg: ModelConfig, checkpoint_dir: Path, final: Path) -> bool:
    written = False
    if be.layout.rank == 0 and not final.exists():
        # the function, not the package attribute: importing the submodule rebinds that name
        convert(str(checkpoint_dir), str(final), hf_config=hf_config(model_cfg).to_dict(), use_mpi=False)
        written = True
    if be.layout.world > 1:
        dist.barrier()
    return written


class PublishError(RuntimeError):
    """The background writer failed to publish a version (raised on the trainer's thread)."""


@dataclass
class PublishRecord:
    """What one background publish cost, in seconds (``superseded``: replaced while waiting)."""

    version: int
    snapshot_s: float                  # on the step: the gather to host memory
    queued_s: float = 0.0              # waiting for the writer
    write_s: float = 0.0               # convert + safetensors + rename + LATEST
    written: bool = False
    superseded: bool = False
    error: str | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class _Job:
    version: int
    step: int
    full: dict
    record: PublishRecord
    submitted: float = field(default_factory=time.perf_counter)


class BackgroundPublisher:
    """HF publishes of the direct path beside the steps (see the module docstring).

    Every rank calls :meth:`submit` at the same steps (the snapshot is a gather); rank 0 owns
    the writer thread.  :meth:`drain` waits until nothing is pending (the loop calls it before
    it exits and before a checkpoint that records the version as published); a writer error
    is raised as :class:`PublishError` by the next :meth:`submit` or :meth:`drain`.
    """

    def __init__(self, run: RunDir, model_cfg: ModelConfig, rank: int) -> None:
        self.run, self.model_cfg, self.rank = run, model_cfg, rank
        self._cond = threading.Condition()
        self._waiting: _Job | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._done: list[PublishRecord] = []
        self._thread: threading.Thread | None = None
        if rank == 0:
            self._thread = threading.Thread(target=self._loop, name="neon-publish", daemon=True)
            self._thread.start()

    def submit(self, be: Backend, version: int, step: int | None = None) -> float:
        """Collective: snapshot the weights as ``v_{version}`` and queue its write; returns the
        seconds the caller spent (the snapshot)."""
        self._raise_error()
        t0 = time.perf_counter()
        full = full_state_dict(be)          # every rank takes part; rank 0 gets host copies
        snap_s = time.perf_counter() - t0
        if self.rank != 0:
            return snap_s
        job = _Job(version, version if step is None else step, full, PublishRecord(version, snap_s))
        with self._cond:
            if self._waiting is not None:
                old = self._waiting.record
                old.superseded = True
                old.queued_s = time.perf_counter() - self._waiting.submitted
                self._done.append(old)
            self._waiting = job
            self._cond.notify_all()
        return snap_s

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every submitted publish is written (or superseded)."""
        if self._thread is None:
            return
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (self._waiting is not None or self._busy) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PublishError(f"weights publish still running after {timeout_s:.0f}s")
                self._cond.wait(left)
        self._raise_error()

    def completed(self) -> list[PublishRecord]:
        """The records finished (written, kept or superseded) since the last call."""
        with self._cond:
            out, self._done = self._done, []
        return out

    def close(self) -> None:
        """Drain, then stop the writer thread."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()

    def _raise_error(self) -> None:
        with self._cond:
            err, self._error = self._error, None
        if err is not None:
            raise PublishError(f"publishing weights failed on the writer thread: {type(err).__name__}: {err}") from err

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                job, self._waiting, self._busy = self._waiting, None, True
            rec = job.record
            rec.queued_s = time.perf_counter() - job.submitted
            t0 = time.perf_counter()
            try:
                rec.written = self._write(job)
            except BaseException as e:      # handed to the trainer's thread
                rec.error = f"{type(e).__name__}: {e}"
                with self._cond:
                    self._error = e
            rec.write_s = time.perf_counter() - t0
            job.full = {}
            with self._cond:
                self._done.append(rec)
                self._busy = False
                self._cond.notify_all()

    def _write(self, job: _Job) -> bool:
        final = self.run.weights_version(job.version)
        written = False
        if not final.exists():                 # published directories are immutable
            save_hf(megatron_to_hf(job.full, self.model_cfg), self.model_cfg, final)
            written = True
        latest = self.run.latest_weights()
        if latest is None or latest[0] <= job.version:
            self.run.publish_latest(job.version, step=job.step)
        return written
