"""The trainer's step loop: claim -> assign -> micro-batches -> forward/loss/backward -> step -> publish.

One process per trainer rank, under the usual torch.distributed variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK; Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
when those are absent).  Everything it knows comes from its view of the config
(:class:`~neon_hpc.train.sections.TrainerSections`) and the run directory, so a restarted (or requeued) trainer
continues where the last checkpoint left it.

Step N (numbered from 1) trains the weights of version N-1 and produces version N:

1. rank 0 claims ``trajectories/claimed/step_N`` (``neon_hpc.store.claim_step``: whole
   shards, resumable, keeping what the stale policy against version N-1 keeps); every rank then
   reads the committed claim (the same call returns the recorded trajectories) and applies the
   stale policy it recorded (``neon_hpc.train.offpolicy``: masks the tokens over the bound);
   the shards the next claim will read are read while the step trains (``store.read_ahead``,
   :mod:`neon_hpc.store.readahead`);
2. GRPO advantages per group (``group_id``, else ``task_id``) over the claimed trajectories;
3. the balancer assigns micro-batches per DP rank (``balance.configured.assignment_for_config``: the
   configured method, cost model and split policy; an error stops the step), sharded over
   each CP group; every rank runs the same number;
4. per micro-batch (built and uploaded on a prefetch thread while the previous one runs:
   :mod:`neon_hpc.train.prefetch`): packed forward with router replay, the off-policy loss
   (:mod:`neon_hpc.train.loss`), backward; then megatron's grad finalisation and optimizer step;
5. metrics + log line (rank 0), heartbeat (every rank);
6. every ``publish_every`` steps: ``weights/v_N`` then ``weights/LATEST`` (direct path: the
   snapshot on the step, the write beside the next steps, :class:`~neon_hpc.train.publish.BackgroundPublisher`);
   every ``checkpoint_every`` steps, every ``checkpoint_every_s`` seconds and at the end:
   ``checkpoints/step_N`` (:mod:`neon_hpc.train.outputs` has the rule; ``train.checkpoint_async``,
   the default: the snapshot on the step, the write beside the next steps, finalized and renamed
   into place at a later step boundary, :class:`~neon_hpc.train.checkpoint.AsyncCheckpointer`;
   false: synchronous).

SIGUSR1 / SIGTERM: the current step finishes, a checkpoint is written (and waited for), then
the preemption marker (``neon_hpc.protocol.Preempted``) and exit 0 (the Slurm job requeues;
resume is automatic).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from neon_hpc.balance.configured import assignment_for_config
from neon_hpc.checkpoint.metadata import CheckpointError
from neon_hpc.config.cross import correction_errors, world_fix
from neon_hpc.config.train import world_size
from neon_hpc.models import cpu_shim
from neon_hpc.protocol.records import Preempted, TrainerBeat, TrainerPhase
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.replay.rows import to_trainer_rows
from neon_hpc.store import ClaimTimeout, open_store
from neon_hpc.train import backend as B, checkpoint as ckpt, corrections, offpolicy, writers
from neon_hpc.train.backend import forward_backward, load_initial_weights, reduce_step_sums
from neon_hpc.train.batch import build_microbatch, input_lengths, packed_length, to_device
from neon_hpc.train.heap import StepHeap
from neon_hpc.train.layout import layout_errors
from neon_hpc.train.loss import (
    group_advantages,
    loss_settings,
    policy_loss,
    staleness_histogram,
    staleness_stats,
    term_means,
    version_span_histogram,
)
from neon_hpc.train.outputs import StepOutputs
from neon_hpc.train.prefetch import Prefetched
from neon_hpc.train.publish import publish_weights
from neon_hpc.train.sections import TrainerSections
from neon_hpc.util.logs import RoleLogger
from neon_hpc.util.netutil import free_port
from neon_hpc.util.procutil import StopFlag
from neon_hpc.util.rankenv import master_port, trainer_rank_from_slurm

ROLE = "trainer"
# One trainer consumes a run directory; a stable name lets a restarted trainer finish its own
# half-done claim (the store refuses a claim owned by another consumer).
CONSUMER = "trainer"
# Rank 0 waits for data in slices this long, so heartbeats and preemption stay live meanwhile.
CLAIM_SLICE_S = 2.0


class TrainerError(RuntimeError):
    """The trainer cannot start or continue; the message says why and what to change."""


# --------------------------------------------------------------------------------------
# process environment and signals

def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank), exporting RANK/WORLD_SIZE/LOCAL_RANK from Slurm if needed."""
    env = os.environ
    trainer_rank_from_slurm(env)
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_PORT" not in env:
        # A single rank needs no agreed rendezvous: any free local port.
        env["MASTER_ADDR"] = "127.0.0.1"
        env["MASTER_PORT"] = str(free_port())
    elif "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
        # Every rank of one job derives the same port from the job id (the launcher may set it instead).
        env["MASTER_PORT"] = str(master_port(env["SLURM_JOB_ID"]))
    if world > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        raise TrainerError(f"rank {rank} of {world}: MASTER_ADDR and MASTER_PORT must be set for a "
                           f"multi-process trainer (the launcher exports them; by hand: "
                           f"MASTER_ADDR=<rank-0 host> MASTER_PORT=<free port>)")
    return rank, world, int(env.get("LOCAL_RANK", "0"))


def _select_device(local_rank: int) -> None:
    """One GPU per rank (NCCL object collectives use the current device); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


class Preemption(StopFlag):
    """Remembers SIGUSR1/SIGTERM; the loop polls it between steps."""

    def __init__(self) -> None:
        super().__init__((signal.SIGUSR1, signal.SIGTERM))


def _any_rank(flag: bool, world: int) -> bool:
    return _any_ranks([flag], world)[0]


def _any_ranks(flags: list[bool], world: int) -> list[bool]:
    """Each flag: set on any rank (one all-reduce for all of them)."""
    return [bool(v) for v in ckpt.max_over_ranks([int(bool(f)) for f in flags], world)]


# --------------------------------------------------------------------------------------
# checks

def check_config(cfg: TrainerSections) -> None:
    for key, msg in correction_errors(cfg) + layout_errors(cfg):
        raise TrainerError(f"{key}: {msg}")
    try:
        corrections.check(cfg.offpolicy)      # offpolicy.correction: importable, registered, the right shape
    except corrections.CorrectionError as e:
        raise TrainerError(str(e)) from None


def check_world(cfg: TrainerSections, world: int) -> None:
    """The processes started must be exactly the layout's ``tp * pp * cp * dp`` ranks."""
    t = cfg.train
    want = world_size(cfg)
    if world != want:
        fix = world_fix(cfg, world, "processes")
        raise TrainerError(f"train.data_parallel: tensor_parallel*pipeline_parallel*context_parallel*data_parallel = "
                           f"{t.tensor_parallel}*{t.pipeline_parallel}*{t.context_parallel}*{t.data_parallel} = "
                           f"{want}, but {world} trainer process(es) started (WORLD_SIZE): {fix}")


# --------------------------------------------------------------------------------------
# one step's data

@dataclass
class StepData:
    trajectories: list
    advantages: np.ndarray
    pieces: list                       # pieces[data_rank][microbatch] = [(seq, start, end), ...] (see rank_pieces)
    method: str
    global_tokens: int               # generated label tokens in the whole step
    waited_s: float = 0.0
    dropped_stale: int = 0
    quarantined: int = 0
    shards: list = field(default_factory=list)
    balance: dict = field(default_factory=dict)   # StepAssignment.summary(): predicted makespan, shadow methods


def _claim(run: RunDir, cfg: TrainerSections, step: int, rank: int, world: int, pre: Preemption,
           log: RoleLogger, store, on_wait=None):
    """Rank 0 claims; then every other rank reads the committed claim back (the same trajectories).

    Rank 0 waits for data in slices of ``CLAIM_SLICE_S`` and tells the others after each one,
    so no collective stays open for long (a process-group timeout is minutes) and heartbeats
    and preemption signals stay live on every rank while rollouts catch up.  ``on_wait()`` runs
    on every rank after each empty slice (the loop finalizes a checkpoint written meanwhile).
    ``store`` is the loop's (``open_store``: it brings ``store.quarantine_invalid``,
    ``store.uid_window_steps`` and the read-ahead of the shards a claim reads).
    """

    # the claim keeps what the stale policy keeps (train/offpolicy.py), which masks after the claim
    kwargs = dict(want=cfg.train.trajectories_per_step, consumer=CONSUMER,
                  admit=offpolicy.StalePolicy.of(cfg.offpolicy, step - 1), poll_s=cfg.protocol.claim_poll_s)
    t0, next_note = time.monotonic(), 10.0
    waited = 0.0   # time blocked with no data: the trainer's idle time (claim I/O is work, not idle)
    mine = None    # rank 0's committed claim (the others read it back from the claim record)
    while True:
        status: dict[str, Any] = {"state": "waiting"}
        if rank == 0:
            left = cfg.train.wait_for_data_s - (time.monotonic() - t0)
            t_slice = time.monotonic()
            try:
                mine = store.claim(step, timeout_s=max(0.0, min(CLAIM_SLICE_S, left)), **kwargs)
                waited += mine.waited_s
                status = {"state": "claimed"}
            except ClaimTimeout as e:
                waited += time.monotonic() - t_slice
                if pre.requested:
                    status = {"state": "preempted"}
                elif left <= CLAIM_SLICE_S:
                    status = {"state": "error", "error": str(e)}
            status["waited_s"] = waited
        status = ckpt.broadcast_from_rank0(status, rank, world)
        if status["state"] == "waiting" and _any_rank(pre.requested, world):
            status["state"] = "preempted"      # a signal reached some rank while rank 0 waited
        if status["state"] != "waiting":
            break
        TrainerBeat(rank=rank, step=step, phase=TrainerPhase.WAITING_FOR_DATA, waited_s=status["waited_s"]).write(run)
        if on_wait is not None:
            on_wait()
        if rank == 0 and status["waited_s"] >= next_note:
            log.info("waiting for data (%.0fs of %.0fs)", status["waited_s"], cfg.train.wait_for_data_s)
            next_note += 30.0
    if status["state"] == "claimed":
        status["result"] = offpolicy.apply(mine if mine is not None else store.claim(step, timeout_s=0.0, **kwargs))
    return status


def _assign(lengths: list[int], dp: int, cfg: TrainerSections):
    """The configured assignment (``balance.configured.assignment_for_config``) for ``dp`` data ranks.

    ``dp`` is the number of data ranks the world gives (DP x CP); the balancer sees
    ``dp / context_parallel`` DP ranks and each of their micro-batches is sharded over the CP
    group (``StepAssignment.cp_shards``).  A method error stops the step: it is raised as a
    :class:`TrainerError` naming the method, never replaced by another packing.
    """
    cp = cfg.train.context_parallel
    if dp % cp:
        raise TrainerError(f"train.context_parallel={cp} does not divide the {dp} data ranks the world gives "
                           f"(world / (tp*pp)); start a multiple of tp*pp*cp processes")
    try:
        return assignment_for_config(lengths, cfg, dp=dp // cp)
    except (ValueError, OSError) as e:
        raise TrainerError(f"balance.method={cfg.balance.method!r} could not balance this step "
                           f"({len(lengths)} sequences, longest {max(lengths, default=0)} tokens): {e}") from e


def rank_pieces(asg, cp: int) -> list[list[list[tuple[int, int, int]]]]:
    """``pieces[data_rank][microbatch]``: what each of the ``dp * cp`` data ranks runs.

    Data rank ``g`` is CP rank ``g % cp`` of DP rank ``g // cp`` (megatron's data-parallel
    rank order); with ``cp > 1`` each DP micro-batch is sharded by ``StepAssignment.cp_shards``.
    """
    out = []
    for r, mbs in enumerate(asg.ranks):
        if cp == 1:
            out.append([[(int(p.seq), int(p.start), int(p.end)) for p in mb] for mb in mbs])
            continue
        shards = [asg.cp_shards(r, j) for j in range(len(mbs))]
        for q in range(cp):
            out.append([[(int(p.seq), int(p.start), int(p.end)) for p in sh[q]] for sh in shards])
    return out


def prepare_step(trajs: list, dp: int, cfg: TrainerSections, log: RoleLogger | None = None) -> StepData:
    to_trainer_rows(trajs, cfg.model)          # engine rows (decoder layers) -> the trainer's MoE layers
    groups = [t.group_id or t.task_id for t in trajs]
    adv = group_advantages([t.reward for t in trajs], groups, norm=cfg.train.advantage_norm)
    for t, a in zip(trajs, adv):
        t.advantage = float(a)
    lengths = input_lengths(trajs)
    asg = _assign(lengths, dp, cfg)
    tokens = int(sum(int(np.count_nonzero(np.asarray(t.loss_mask)[1:])) for t in trajs))
    return StepData(trajs, adv, rank_pieces(asg, cfg.train.context_parallel), cfg.balance.method, tokens,
                    balance=asg.summary())


# --------------------------------------------------------------------------------------
# one optimizer step

def train_step(be, data: StepData, settings: dict | None, loss=None, means=term_means) -> dict[str, float]:
    """Forward/backward every micro-batch of this rank, then one optimizer step; returns metrics.

    ``settings``: :func:`~neon_hpc.train.loss.loss_settings` (the policy loss's keyword arguments);
    ``loss(logp, mb, denom) -> (loss, terms)`` replaces the policy loss (the SFT step,
    :mod:`neon_hpc.train.sft`), ``means(sums)`` its per-token means for the metrics record.
    """
    # deferred: heavy (neon_hpc.models.cp_attention: megatron, wandb)
    from neon_hpc.models.cp_attention import build_piece_map, piece_map

    lay = be.layout
    mine = data.pieces[lay.dp_rank] if lay.dp_rank < len(data.pieces) else []
    n_mb = max(len(r) for r in data.pieces) if data.pieces else 0
    # the K/V exchange group of split pieces: every data rank (DP x CP) of this TP/PP position;
    # every rank runs every slot's layers, so its one all-gather per layer cannot deadlock
    group = _exchange_group(len(data.pieces))
    t_fb, c_fb = time.perf_counter(), time.process_time()
    route_shape = (be.num_moe_layers(), be.model_cfg.moe_router_topk, be.model_cfg.num_experts) if be.replay else None
    denom = be.loss_scale(max(data.global_tokens, 1))
    dev = _device()

    def build(j: int):
        """Micro-batch ``j`` of this rank, uploaded, and its piece map (on the prefetch thread)."""
        pieces = mine[j] if j < len(mine) else []
        mb = build_microbatch(data.trajectories, pieces, data.advantages, pad_multiple=be.pad_multiple,
                              route_shape=route_shape, dense_mask=False)
        slot = [r[j] if j < len(r) else [] for r in data.pieces]
        return to_device(mb, dev), build_piece_map(slot, lay.dp_rank, mb.seq_len, group=group, device=dev)

    # built beside the device: micro-batch j + 1 while the schedule runs j (train/prefetch.py)
    built = Prefetched(n_mb, build)
    seq_length = max((packed_length(mine[j] if j < len(mine) else [], be.pad_multiple) for j in range(n_mb)),
                     default=1)
    be.zero_grad()                     # every model chunk's grad buffer and the optimizer

    def loss_fn(logp, mb):
        if loss is not None:
            return loss(logp, mb, denom)
        return policy_loss(logp, logp.detach(), mb.behaviour_logprobs, mb.advantages, mb.loss_mask, denom, **settings)

    # megatron's schedule (1F1B under PP) runs the micro-batches in the assignment's order
    sums = forward_backward(be, _Column(built, 0), loss_fn, forward_context=lambda j: piece_map(built[j][1]),
                            seq_length=seq_length)
    items = built.all()
    replay_missing = sum(mb.routed_experts_missing for mb, _ in items)
    replayed = sum(int(mb.routed_experts is not None and bool(mine[j] if j < len(mine) else [])) for j, (mb, _) in
                   enumerate(items))
    sums["replay_docs_missing"] = float(replay_missing)
    sums["replayed_microbatches"] = float(replayed)
    sums["exchanged_microbatches"] = float(sum(a.exchanges for _, a in items))   # with a K/V all-gather
    fb_s, fb_cpu = time.perf_counter() - t_fb, time.process_time() - c_fb
    be.finalize_grads()                # finalize_model_grads over every model chunk
    ok, grad_norm, _ = be.optimizer.step()
    sums = reduce_step_sums(be, sums)
    out = means(sums)
    out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    out["update_skipped"] = not ok
    out["microbatches"] = n_mb
    out["replay_docs_missing"] = int(sums["replay_docs_missing"])
    out["replayed_microbatches"] = int(sums["replayed_microbatches"])
    out["exchanged_microbatches"] = int(sums["exchanged_microbatches"])
    out["fwd_bwd_s_max"], out["fwd_bwd_s_mean"] = _max_mean(fb_s, len(data.pieces))
    # CPU time of this process over the same span (no time waiting for a busy CPU or a peer)
    out["fwd_bwd_cpu_s_max"], out["fwd_bwd_cpu_s_mean"] = _max_mean(fb_cpu, len(data.pieces))
    return out


class _Column:
    """``seq[j][k]`` as a sequence (read lazily: item ``j`` when it is asked for)."""

    def __init__(self, seq, k: int) -> None:
        self.seq, self.k = seq, k

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, j):
        return self.seq[j][self.k]


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _exchange_group(data_ranks: int):
    if data_ranks == 1:
        return None
    from megatron.core import parallel_state as ps  # deferred: heavy (megatron)
    return ps.get_data_parallel_group()


def _max_mean(x: float, data_ranks: int) -> tuple[float, float]:
    """(max, mean) of a per-rank float over the data ranks (this rank's value alone without them)."""
    if data_ranks == 1:
        return x, x
    t = torch.tensor([x, x], dtype=torch.float64, device=_device())
    g = _exchange_group(data_ranks)
    mx, sm = t[:1].clone(), t[1:].clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=g)
    dist.all_reduce(sm, group=g)
    return float(mx.item()), float(sm.item()) / data_ranks


# --------------------------------------------------------------------------------------
# the loop

def setup_backend(cfg: TrainerSections, replay: bool, log: RoleLogger):
    """This rank's Backend from the train section (RL and SFT build it alike); rank 0 logs the
    optional kernels it found."""
    t = cfg.train
    be = B.setup(cfg.model, tp=t.tensor_parallel, ep=t.expert_parallel, pp=t.pipeline_parallel, lr=t.lr,
                 weight_decay=t.weight_decay, grad_clip=t.grad_clip, replay=replay, seed=t.seed,
                 pp_first_stage_layers=t.pipeline_first_stage_layers,
                 pp_last_stage_layers=t.pipeline_last_stage_layers, vpp=t.virtual_pipeline_stages,
                 cp=t.context_parallel, precision=t.precision, recompute=t.recompute)
    if be.layout.rank == 0:
        log.info("kernels %s", json.dumps(cpu_shim.kernels(), sort_keys=True))
    return be


def _startup(run: RunDir, be, cfg: TrainerSections, log: RoleLogger) -> tuple[int, dict]:
    """Resume from the newest checkpoint, or initialise; returns (last completed step, state)."""
    last = ckpt.latest_complete(run) if be.layout.rank == 0 else None
    last = ckpt.broadcast_from_rank0(last, be.layout.rank, be.layout.world)
    if last is not None:
        try:
            ckpt.check_precision(run.checkpoint(last), ckpt.read_state(run.checkpoint(last)), be.precision)
        except ValueError as e:                 # a one-line refusal naming the key, not a traceback
            raise TrainerError(str(e)) from None
        state = ckpt.load(run, be, last)
        log.info("resumed from %s (step %d, rng %s)", run.checkpoint(last), last,
                 "restored" if state["rng_restored"] else "reseeded: layout changed")
        if not state["rng_restored"]:
            torch.manual_seed(cfg.train.seed + last)
        return last, state
    if cfg.model.init_checkpoint:
        load_initial_weights(be, cfg.model.init_checkpoint)
        log.info("initial weights from %s", cfg.model.init_checkpoint)
    else:
        log.info("initial weights: megatron init, seed %d", cfg.train.seed)
    return 0, {}


def run_trainer(cfg: TrainerSections, run_dir: str) -> int:
    """Train until ``train.steps`` (or a preemption signal); returns the process exit code.

    0: done, or preempted after a checkpoint (requeue and call again); 2: refused to start
    or cannot continue (config, environment, an untrusted or corrupt checkpoint, no data within
    ``train.wait_for_data_s``).
    """
    try:
        check_config(cfg)
        rank, world, local = dist_env()
        check_world(cfg, world)
    except TrainerError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return 2
    _select_device(local)
    run = RunDir(run_dir).create()
    log = RoleLogger.open(run.root, ROLE, rank, echo=True)
    pre = Preemption().install()
    try:
        if cfg.model.init_checkpoint and ckpt.latest_complete(run) is None:
            ckpt.check_init_checkpoint(cfg.model.init_checkpoint)   # refused before the model is built
        if cfg.train.mode == "sft":      # the same model, layouts and books; another loss and data source
            from neon_hpc.train.sft import run_sft  # deferred: cycle (neon_hpc.train.sft imports this module)
            return run_sft(cfg, run, rank, world, log, pre)
        return _run(cfg, run, rank, world, log, pre)
    except TrainerError as e:
        log.error("%s", e)
        return 2
    except ckpt.CheckpointWriteError as e:
        # an asynchronous checkpoint failed beside the steps (its staging folder is gone, nothing was
        # published, the last complete checkpoint stands): one line, no traceback
        log.error("%s", e)
        return 2
    except CheckpointError as e:
        # an untrusted or corrupt checkpoint (init_checkpoint, or a resume's step_N): one line naming
        # the file, what in it is refused, and what to do; no traceback
        log.error("refused checkpoint: %s", " | ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()))
        return 2
    finally:
        pre.restore()
        log.close()


def _run(cfg: TrainerSections, run: RunDir, rank: int, world: int, log: RoleLogger, pre: Preemption) -> int:
    t = cfg.train
    writers.configure(t.checkpoint_write_timeout_s)   # the deadline of a save's megatron writers
    TrainerBeat(rank=rank, phase=TrainerPhase.STARTING).write(run)
    be = setup_backend(cfg, replay=cfg.offpolicy.replay_trainer == "replay", log=log)
    last, _state = _startup(run, be, cfg, log)
    log.info("layout tp=%d ep=%d dp=%d world=%d, replay=%s, correction=%s, precision=%s, recompute=%s",
             be.layout.tp, be.layout.ep, be.layout.dp, world, be.replay, cfg.offpolicy.correction, be.precision,
             be.recompute)
    if not run.weight_versions() or run.latest_weights() is None:
        via = t.publish_via
        if via == "reshard" and not run.checkpoint(last).is_dir():
            ckpt.save(run, be, last, {"version": last, "cursor": {"next_step": last + 1}, "published": last})
        _, secs, _ = publish_weights(run, be, cfg.model, last, step=last, via=via,
                                     checkpoint_dir=run.checkpoint(last))
        log.info("published initial weights v_%d in %.2fs (%s)", last, secs, via)
    settings = loss_settings(cfg)
    step = last
    saved_at = last
    preempted = False
    memory = StepHeap.from_env(run.log_dir(ROLE), rank)   # freed heap back to the OS after each step
    outputs = StepOutputs(run, be, cfg, log, rank)         # publishes and checkpoints (train/outputs.py)
    store = open_store(run, cfg.store)
    while step < t.steps:
        step += 1
        log.set(step=step, version=step - 1)
        t0 = time.perf_counter()
        TrainerBeat(rank=rank, step=step, version=step - 1, phase=TrainerPhase.CLAIMING).write(run)
        ahead = store.read_ahead_counts()
        claim = _claim(run, cfg, step, rank, world, pre, log, store, on_wait=outputs.poll)
        ahead = [n - n0 for n, n0 in zip(store.read_ahead_counts(), ahead)]   # this claim's shards: memory, disk
        if claim["state"] == "preempted":
            step -= 1
            preempted = True
            break
        if claim["state"] == "error":
            raise TrainerError(claim["error"])
        res = claim["result"]
        # right after the claim: rollout workers waiting for admission watch this phase change
        TrainerBeat(rank=rank, step=step, version=step - 1, phase=TrainerPhase.TRAINING).write(run)
        store.read_ahead(t.trajectories_per_step)   # the next claim's shards read while this step trains
        data = prepare_step(res.trajectories, be.layout.dp, cfg, log if rank == 0 else None)
        ts = time.perf_counter()
        m = train_step(be, data, settings)
        m["train_step_s"] = time.perf_counter() - ts     # the bare step (the loop's time is step_time_s)
        m["read_ahead_hits"], m["read_ahead_misses"] = ahead
        stop, timed = _any_ranks([pre.requested, outputs.time_due()], world)
        published, saved = outputs.after_step(step, stop, m, {"claimed_shards": [p.name for p in res.shards]},
                                              timed=timed)
        if saved:
            saved_at = step
        _report(run, log, rank, step, res, data, m, claim.get("waited_s", 0.0), time.perf_counter() - t0, published)
        memory.after_step(step, input_lengths(data.trajectories))
        if stop:
            preempted = True
            break
    store.close()
    outputs.close()       # the last version written and the last checkpoint complete before the trainer exits
    return finish(run, be, log, rank, step, saved_at, preempted, pre)


def finish(run: RunDir, be, log: RoleLogger, rank: int, step: int, saved_at: int, preempted: bool,
           pre: Preemption, state: dict | None = None, what: str = "done") -> int:
    """The end of a trainer run (RL or SFT): a preempted one checkpoints what it has not saved and
    records the preemption (exit 0, for requeue); either way the last heartbeat, then teardown."""
    if preempted:
        if saved_at != step:
            ckpt.save(run, be, step, {"version": step, "cursor": {"next_step": step + 1}, **(state or {})})
        if rank == 0:
            Preempted(step=step, signal=pre.signum, checkpoint=str(run.checkpoint(step))).write(run)
        log.info("preempted (signal %s): checkpoint step_%d written, exiting 0 for requeue", pre.signum, step)
    else:
        log.info("%s: %d steps", what, step)
    TrainerBeat(rank=rank, step=step, version=step,
                phase=TrainerPhase.PREEMPTED if preempted else TrainerPhase.DONE).write(run)
    B.teardown()
    return 0


def _report(run: RunDir, log: RoleLogger, rank: int, step: int, res, data: StepData, m: dict,
            waited_s: float, step_s: float, published: int | None) -> None:
    TrainerBeat(rank=rank, step=step, version=step, phase=TrainerPhase.STEPPED).write(run)
    if rank != 0:
        return
    trajs = data.trajectories
    # staleness of the tokens that trained (stale ones masked by the claim are not among them)
    hist = staleness_histogram(step - 1, [np.asarray(t.versions)[np.asarray(t.loss_mask) != 0] for t in trajs])
    s_mean, s_max = staleness_stats(hist)
    tokens = int(sum(len(t.tokens) for t in trajs))
    rec = dict(step=step, version=step, published=published, step_time_s=step_s, wait_s=waited_s,
               tokens=tokens, gen_tokens=data.global_tokens, trajectories=len(trajs),
               tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
               reward_mean=float(np.mean([t.reward for t in trajs])) if trajs else float("nan"),
               staleness_mean=s_mean, staleness_max=s_max, staleness_hist=hist,
               dropped_stale=res.dropped_stale, quarantined=len(res.quarantined), shards=len(res.shards),
               duplicates_skipped=res.duplicates,
               masked_stale_tokens=res.masked_stale_tokens, dropped_stale_tokens=res.dropped_stale_tokens,
               claimed_gen_tokens=res.generated_tokens, wasted_rollout_tokens=res.wasted_rollout_tokens,
               version_spans=version_span_histogram(np.asarray(t.versions) for t in trajs),
               method=data.method, assignment=data.balance, **m)
    log.metrics(**rec)
    log.info("step %d: loss %.4f reward %.3f tokens %d (%.0f/s) staleness mean %.2f max %d, tis clip %.3f, "
             "mismatch %.4f, grad %.3f, %.2fs (waited %.2fs)", step, m.get("loss", float("nan")),
             rec["reward_mean"], tokens, rec["tokens_per_s"], s_mean, s_max, m.get("tis_clip_frac", 0.0),
             m.get("mismatch_abs_mean", 0.0), m["grad_norm"], step_s, waited_s)
