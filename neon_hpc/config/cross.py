"""The rules across sections of the experiment config, each written once.

A rule here reads more than one section (the model and the trainer's layout, the launch and the
trainer's world, the environment and the eval split).  The config loader runs
:func:`cross_errors` after every section passed its own checks (``ExperimentConfig.CROSS``), so
``neon-hpc config check`` refuses what a role would refuse later; the trainer runs
:func:`correction_errors` and :func:`layout_errors` again at its start (``train/loop.py``), on
the view it is given.  Each returns ``[(key path, message)]``: empty means fine.
"""
from __future__ import annotations

from typing import Any

from neon_hpc import envs
from neon_hpc.config.model import arch_experiment_errors
from neon_hpc.config.rollout import layout
from neon_hpc.config.train import stage_layers, world_size
from neon_hpc.util.bounded import short_repr

Errors = list[tuple[str, str]]


def cross_errors(cfg: Any) -> list[tuple[str, str]]:
    """``[(key path, message)]``: what the rules across sections refuse (empty = fine)."""
    errs = []
    if cfg.rollout.max_total_tokens > cfg.model.max_position_embeddings:
        # the engines refuse prompt + generation beyond the context (embedded: engines.embedded.admit)
        errs.append(("rollout.max_total_tokens",
                     f"{cfg.rollout.max_total_tokens} is over model.max_position_embeddings "
                     f"({cfg.model.max_position_embeddings}): episodes would grow past the context the "
                     f"engines serve; lower it to at most {cfg.model.max_position_embeddings}"))
    errs += correction_errors(cfg)
    if cfg.train.expert_parallel > 1 and cfg.model.num_experts % cfg.train.expert_parallel:
        errs.append(("train.expert_parallel",
                     f"must divide model.num_experts ({cfg.model.num_experts})"))
    if cfg.train.tensor_parallel > 1 and cfg.model.num_query_groups % cfg.train.tensor_parallel:
        errs.append(("train.tensor_parallel",
                     f"must divide model.num_query_groups ({cfg.model.num_query_groups})"))
    errs += arch_experiment_errors(cfg)                  # what the architecture refuses elsewhere
    errs += eval_split_errors(cfg)                       # a held-out split of the chosen environment
    cp, thr = cfg.train.context_parallel, cfg.balance.split_threshold_tokens
    if thr and (cp == 1 or thr < 2 * cp):
        errs.append(("balance.split_threshold_tokens",
                     f"{thr}: zigzags pieces into 2*train.context_parallel chunks, so it needs "
                     f"context_parallel > 1 (now {cp}) and a threshold >= 2*context_parallel; set it "
                     f"to 0 (auto) or raise it"))
    errs += layout_errors(cfg) + launch_world_errors(cfg)   # the trainer's own rules (train section)
    if cfg.engine.kind == "sglang":
        lay = layout(cfg)
        if cfg.launch.rollout.nodes < lay.nodes_needed:
            errs.append(("launch.rollout.nodes",
                         f"{cfg.engine.num_engines} engine(s) of {lay.gpus_per_engine} GPUs "
                         f"(engine.tp_size x dp_size) need {lay.nodes_needed} node(s) of "
                         f"{lay.gpus_per_node} GPUs, the rollout group has {cfg.launch.rollout.nodes}: "
                         f"raise launch.rollout.nodes or lower engine.num_engines"))
        if cfg.engine.pd_disaggregation and is_loopback(cfg.engine.host) and lay.nodes_needed > 1:
            errs.append(("engine.host",
                         f"{cfg.engine.host} is reachable from its own node only, but the PD router and "
                         f"the engines of this layout are on {lay.nodes_needed} nodes: set engine.host: "
                         f"0.0.0.0 (or the nodes' fabric address)"))
    return errs


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def correction_errors(cfg: Any) -> Errors:
    """An async run needs an off-policy correction (the config loader and the trainer's start ask here)."""
    if cfg.schedule == "async" and cfg.offpolicy.correction == "none":
        return [("offpolicy.correction",
                 "'none' in an async run trains on tokens of older weight versions without correction "
                 "(a silent bias); set it to 'tis' or schedule: sync")]
    return []


def layout_errors(cfg: Any) -> Errors:
    """Every layout rule the trainer enforces, as ``[(key, message), ...]`` (empty = fine)."""
    t, m = cfg.train, cfg.model
    errs: Errors = []
    tp, pp, cp, dp, ep = (t.tensor_parallel, t.pipeline_parallel, t.context_parallel, t.data_parallel,
                          t.expert_parallel)
    if min(tp, pp, cp, dp, ep) < 1:
        return errs                       # reported by the train section's own validate()
    if (tp * cp * dp) % ep:
        errs.append(("train.expert_parallel",
                     f"{ep} must divide tensor_parallel*context_parallel*data_parallel = {tp}*{cp}*{dp} = "
                     f"{tp * cp * dp} (the ranks of one pipeline stage hold the experts, expert TP = 1); "
                     f"change train.expert_parallel or train.data_parallel"))
    if m.vocab_size % tp:
        errs.append(("train.tensor_parallel",
                     f"{tp} must divide model.vocab_size ({m.vocab_size}): the embedding and output layer are "
                     f"split by vocabulary rows over TP"))
    for k in ("pipeline_first_stage_layers", "pipeline_last_stage_layers"):
        if getattr(t, k) < 0:
            errs.append((f"train.{k}", "must be >= 0 (0 = an even share)"))
    if t.virtual_pipeline_stages < 1:
        errs.append(("train.virtual_pipeline_stages", "must be >= 1 (1 = plain 1F1B)"))
    if errs:
        return errs
    try:
        per_stage = stage_layers(m.num_layers, pp, t.pipeline_first_stage_layers, t.pipeline_last_stage_layers)
    except ValueError as e:
        key = "train.pipeline_parallel" if not (t.pipeline_first_stage_layers or t.pipeline_last_stage_layers) \
            else "train.pipeline_first_stage_layers"
        errs.append((key, f"model.num_layers={m.num_layers} over pipeline_parallel={pp} stages: {e}; "
                          f"pick a pipeline_parallel that divides it, or set train.pipeline_first_stage_layers "
                          f"/ pipeline_last_stage_layers so the remaining stages divide evenly"))
        return errs
    v = t.virtual_pipeline_stages
    if v > 1:
        if pp == 1:
            errs.append(("train.virtual_pipeline_stages",
                         f"{v} model chunks per stage need train.pipeline_parallel > 1 (the interleaved "
                         f"schedule runs over pipeline stages); set it to 1 or raise train.pipeline_parallel"))
        else:
            bad = [(i, n) for i, n in enumerate(per_stage) if n % v]
            if bad:
                i, n = bad[0]
                errs.append(("train.virtual_pipeline_stages",
                             f"{v} must divide the layers of every pipeline stage ({per_stage} per stage; "
                             f"stage {i} has {n}): each stage holds {v} model chunks of equal size (megatron's "
                             f"interleaved layout); pick a virtual_pipeline_stages that divides them, or change "
                             f"train.pipeline_first_stage_layers / pipeline_last_stage_layers"))
            mb = cfg.balance.min_microbatches
            if 0 < mb < pp:
                errs.append(("balance.min_microbatches",
                             f"{mb} < train.pipeline_parallel={pp}: the interleaved schedule "
                             f"(virtual_pipeline_stages={v}) needs at least one micro-batch per stage; "
                             f"set it to 0 (= pipeline_parallel) or >= {pp}"))
    return errs


def world_fix(cfg: Any, started: int, unit: str) -> str:
    """What to change when ``started`` processes (``unit``: "ranks", "processes") are not the layout's."""
    per_replica = world_size(cfg) // cfg.train.data_parallel
    return (f"set train.data_parallel: {started // per_replica}" if started % per_replica == 0 else
            f"start a multiple of tp*pp*cp = {per_replica} {unit}")


def launch_world_errors(cfg: Any) -> Errors:
    """A Slurm train group must start exactly ``world_size(cfg)`` ranks."""
    g = cfg.launch.train
    if cfg.launch.backend != "slurm":
        return []
    started = g.nodes * g.tasks_per_node
    want = world_size(cfg)
    if started == want:
        return []
    t = cfg.train
    fix = world_fix(cfg, started, "ranks")
    return [("train.data_parallel",
             f"tensor_parallel*pipeline_parallel*context_parallel*data_parallel = {t.tensor_parallel}*"
             f"{t.pipeline_parallel}*{t.context_parallel}*{t.data_parallel} = {want} ranks, but launch.train "
             f"starts nodes*tasks_per_node = {g.nodes}*{g.tasks_per_node} = {started}: {fix}, "
             f"or change launch.train")]


def eval_split_errors(cfg) -> list[tuple[str, str]]:
    """``eval.split`` against the held-out splits of the environment ``env.kind`` chooses (its
    registry line; a rule across sections: :func:`cross_errors`)."""
    splits = envs.eval_splits(cfg.env.kind)
    if cfg.eval.split in splits:
        return []
    return [("eval.split", f"got {short_repr(cfg.eval.split)}; allowed: a held-out split of environment "
                           f"{cfg.env.kind}: {', '.join(splits)}")]
