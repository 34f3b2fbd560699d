"""Supervised fine-tuning / mid-training in the RL trainer (``train.mode: sft``).

The same megatron model, parallel layout, balancer, micro-batches and optimizer as the RL step
loop (:mod:`neon_hpc.train.loop`): only the data source and the loss differ.

- Data: the fixed trajectory set in ``train.sft_data`` (``store.kind``'s ``read_set``: every
  HDF5 shard ``*.h5`` of the folder for the filesystem store), read by every rank. Step N takes
  ``train.trajectories_per_step`` trajectories from a fixed order: epoch e is a permutation of the whole set
  drawn from ``train.seed + e``, epochs concatenated. So the step number is the data cursor, as in RL: a resumed
  run takes exactly the batches the uninterrupted one would have.
- Loss: :func:`neon_hpc.train.loss.sft_loss`, cross-entropy on the tokens whose
  ``loss_mask`` is 1 (a demonstration's assistant tokens), summed and divided by the step's
  marked tokens.
- Checkpoints (``checkpoints/step_N``, torch_dist) and published weights (``weights/v_N``, HF)
  exactly as RL writes them (:class:`~neon_hpc.train.outputs.StepOutputs`: the same keys
  ``checkpoint_every``, ``publish_every``, ``publish_via``, ``checkpoint_async``, beside the steps
  where RL's are), so an RL run starts from either through ``model.init_checkpoint``. Resume
  from the newest checkpoint and SIGUSR1/SIGTERM behave as in RL. Routes are not replayed
  (demonstrations carry none; the router learns freely).

Metrics (``logs/trainer/metrics.jsonl``, rank 0): ``step, mode ("sft"), loss`` (mean nats per
marked token), ``perplexity, loss_tokens, tokens, trajectories, epoch, step_time_s,
grad_norm, publish_s, checkpoint_s``.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.records import TrainerBeat, TrainerPhase
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.store import store_kind
from neon_hpc.train import writers
from neon_hpc.train.loop import TrainerError, _any_ranks, _startup, finish, prepare_step, setup_backend, train_step
from neon_hpc.train.loss import sft_loss, sft_term_means
from neon_hpc.train.outputs import StepOutputs
from neon_hpc.train.sections import TrainerSections
from neon_hpc.util.logs import RoleLogger


def load_sft_set(folder: str, kind: str = StoreConfig.kind) -> list:
    """Every trajectory of the fixed set in ``folder`` (the store ``kind``'s ``read_set``)."""
    if not folder:
        raise TrainerError("train.sft_data is empty: train.mode: sft needs a folder of trajectory shards "
                           "(write demonstrations with `neon-hpc demos --out DIR`)")
    p = Path(folder)
    trajs = store_kind(kind).read_set(p)
    if not trajs:
        raise TrainerError(f"train.sft_data: no *.h5 trajectory shards in {p} (write demonstrations with "
                           f"`neon-hpc demos --out {p}`)")
    if not any(int(np.count_nonzero(np.asarray(t.loss_mask)[1:])) for t in trajs):
        raise TrainerError(f"train.sft_data: the shards in {p} mark no token to train on (loss_mask is 0)")
    return trajs


def step_indices(n: int, step: int, per_step: int, seed: int) -> tuple[list[int], int]:
    """Indices into the SFT set for ``step`` (from 1), and the epoch it starts in."""
    start = (step - 1) * per_step
    out, epoch = [], start // n
    first_epoch = epoch
    pos = start - epoch * n
    while len(out) < per_step:
        order = np.random.default_rng(seed + epoch).permutation(n)
        take = order[pos:pos + per_step - len(out)]
        out += [int(i) for i in take]
        epoch, pos = epoch + 1, 0
    return out, first_epoch


def _loss(logp, mb, denom):
    return sft_loss(logp, mb.loss_mask.to(logp.device), denom)


def run_sft(cfg: TrainerSections, run: RunDir, rank: int, world: int, log: RoleLogger, pre) -> int:
    """The SFT step loop (``train.mode: sft``); called by :func:`neon_hpc.train.loop.run_trainer`."""


    t = cfg.train
    writers.configure(t.checkpoint_write_timeout_s)
    TrainerBeat(rank=rank, phase=TrainerPhase.STARTING).write(run)
    data_set = load_sft_set(t.sft_data, cfg.store.kind)
    be = setup_backend(cfg, replay=False, log=log)
    last, _state = _startup(run, be, cfg, log)
    log.info("sft: %d trajectories from %s, %d steps of %d, layout tp=%d ep=%d dp=%d world=%d", len(data_set),
             t.sft_data, t.steps, t.trajectories_per_step, be.layout.tp, be.layout.ep, be.layout.dp, world)
    step, saved_at, preempted = last, last, False
    outputs = StepOutputs(run, be, cfg, log, rank)   # publishes and checkpoints as RL's (train/outputs.py)
    while step < t.steps:
        step += 1
        log.set(step=step, version=step - 1)
        t0 = time.perf_counter()
        TrainerBeat(rank=rank, step=step, version=step - 1, phase=TrainerPhase.TRAINING).write(run)
        idx, epoch = step_indices(len(data_set), step, t.trajectories_per_step, t.seed)
        trajs = [copy.copy(data_set[i]) for i in idx]
        data = prepare_step(trajs, be.layout.dp, cfg)
        m = train_step(be, data, None, loss=_loss, means=sft_term_means)
        stop, timed = _any_ranks([pre.requested, outputs.time_due()], world)
        _published, saved = outputs.after_step(step, stop, m, {"mode": "sft"}, timed=timed)
        if saved:
            saved_at = step
        TrainerBeat(rank=rank, step=step, version=step, phase=TrainerPhase.STEPPED).write(run)
        if rank == 0:
            dt = time.perf_counter() - t0
            rec = dict(step=step, version=step, mode="sft", epoch=epoch, trajectories=len(trajs),
                       tokens=int(sum(len(x.tokens) for x in trajs)), gen_tokens=data.global_tokens,
                       step_time_s=dt, **m)
            log.metrics(**rec)
            log.info("sft step %d: loss %.4f (ppl %.2f) on %d tokens, epoch %d, grad %.3f, %.2fs", step,
                     m.get("loss", float("nan")), m.get("perplexity", float("nan")), m.get("loss_tokens", 0),
                     epoch, m["grad_norm"], dt)
        if stop:
            preempted = True
            break
    outputs.close()
    return finish(run, be, log, rank, step, saved_at, preempted, pre, state={"mode": "sft"}, what="sft done")
