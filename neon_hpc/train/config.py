"""Trainer section of the experiment config (owned by ``neon_hpc/train``), and the trainer's
parallel layout rules (plain arithmetic on the config: no torch, no processes).

The layout rules are written once, here, beside the section: the trainer checks them before it
builds anything (:func:`neon_hpc.train.loop.check_config`) and the config loader runs the same
list with its cross-section rules (``neon_hpc.config.cross_errors``), so ``neon-hpc config
check`` refuses a layout the trainer cannot honour before any process starts, with the key to
change.  :mod:`neon_hpc.train.layout` re-exports them beside the model-chunk assignment.

World: ``tp * pp * cp * dp`` ranks (``train.data_parallel`` is the DP size, not a hint).
Expert layout per pipeline stage: ``ep * expert_tp(=1) * expert_dp = tp * cp * dp``, so ``ep``
must divide ``tp * cp * dp``.  Layers per pipeline stage: even, or with
``train.pipeline_first_stage_layers`` / ``pipeline_last_stage_layers`` set the first/last
stage take that many and the others share the rest evenly (megatron-core's
``num_layers_in_first/last_pipeline_stage``).  With ``train.virtual_pipeline_stages: V > 1``
(interleaved 1F1B) V must divide every stage's layer count (megatron's rule, uneven first/last
stages included).
"""
from dataclasses import dataclass
from typing import Any, Literal

from neon_hpc.constraints import Range, Rule, above, at_least, between, section


@section
@dataclass
class TrainConfig:
    mode: Literal["rl", "sft"] = "rl"   # sft: cross-entropy on the loss-masked tokens of train.sft_data (train/sft.py)
    sft_data: str = ""                   # sft: a folder of HDF5 trajectory shards (e.g. `neon-hpc demos --out DIR`)
    steps: int = 8
    trajectories_per_step: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2                # PPO ratio clip
    off_policy_correction: Literal["tis", "none"] = "tis"
    tis_cap: float = 2.0                 # truncated importance sampling cap per token
    kl_coef: float = 0.0                 # k3 KL toward the behaviour (engine) policy, per token
    advantage_norm: Literal["std", "none"] = "std"   # GRPO: divide by the group's reward std, or only centre
    router_replay: Literal["off", "replay"] = "replay"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    data_parallel: int = 1               # the DP size: world = tp * pp * cp * dp (world_size below)
    pipeline_first_stage_layers: int = 0   # uneven PP: layers on the first stage (0 = even share)
    pipeline_last_stage_layers: int = 0    # uneven PP: layers on the last stage (0 = even share)
    virtual_pipeline_stages: int = 1     # > 1: interleaved 1F1B with this many model chunks per stage
    checkpoint_every: int = 4
    publish_every: int = 1
    publish_via: Literal["direct", "reshard"] = "direct"   # HF export: in-memory gather, or reshard the checkpoint
    wait_for_data_s: float = 600.0
    checkpoint_write_timeout_s: float = 1800.0   # a save whose megatron writers have not all reported by then fails
    seed: int = 1234
    # bf16: bf16 parameters and activations, fp32 main parameters, gradients and Adam state
    # (megatron's Float16Module + mixed-precision optimizer); auto = bf16 on CUDA, fp32 on CPU
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # activation recomputation: full = each layer recomputed in backward from its input;
    # selective = the MoE layer and the norms (train/backend.recompute_overrides); the
    # capacity planner's memory term reads it (plan/memory.py)
    recompute: Literal["none", "selective", "full"] = "none"

    CHECKS = {
        "steps": between(1, 10**9),
        "lr": above(0, le=1.0),
        "weight_decay": at_least(0),
        "grad_clip": at_least(0, "0 = no clipping"),
        "clip_eps": Range(gt=0, lt=1),
        "tis_cap": at_least(1.0, "it truncates importance ratios from above"),
        "kl_coef": at_least(0),
        **{k: at_least(1) for k in ("trajectories_per_step", "checkpoint_every", "publish_every",
                                    "tensor_parallel", "pipeline_parallel", "expert_parallel",
                                    "context_parallel", "data_parallel", "virtual_pipeline_stages")},
        "wait_for_data_s": above(0, note="seconds"),
        "checkpoint_write_timeout_s": above(0, note="seconds (train/writers.py: stuck checkpoint writers)"),
    }
    RULES = (
        Rule("sft_data", lambda c: c.mode != "sft" or bool(c.sft_data),
             "a folder of trajectory shards when train.mode is 'sft' (write demonstrations with "
             "`neon-hpc demos --out DIR`)"),
    )


# --------------------------------------------------------------------------------------
# the trainer's layout rules

Errors = list[tuple[str, str]]


def correction_errors(cfg: Any) -> Errors:
    """An async run needs an off-policy correction (the config loader and the trainer's start ask here)."""
    if cfg.mode == "async" and cfg.train.off_policy_correction == "none":
        return [("train.off_policy_correction",
                 "'none' in an async run trains on tokens of older weight versions without correction "
                 "(a silent bias); set it to 'tis' or mode: sync")]
    return []


def world_size(cfg: Any) -> int:
    """Trainer ranks the config asks for: ``tp * pp * cp * dp``."""
    t = cfg.train
    return t.tensor_parallel * t.pipeline_parallel * t.context_parallel * t.data_parallel


def stage_layers(num_layers: int, pp: int, first: int = 0, last: int = 0) -> list[int]:
    """Decoder layers on each pipeline stage (``first``/``last`` 0 = even share); raises ValueError."""
    if pp == 1:
        if first or last:
            raise ValueError("only meaningful with train.pipeline_parallel > 1")
        return [num_layers]
    fixed = {}
    if first:
        fixed[0] = first
    if last:
        fixed[pp - 1] = last
    rest_stages = pp - len(fixed)
    rest = num_layers - sum(fixed.values())
    if rest_stages == 0:
        if rest:
            raise ValueError(f"first + last stage layers ({sum(fixed.values())}) != model.num_layers ({num_layers})")
        return [fixed[0], fixed[1]]
    if rest <= 0 or rest % rest_stages:
        raise ValueError(f"{rest} layer(s) left for {rest_stages} middle/even stage(s) do not divide evenly")
    return [fixed.get(i, rest // rest_stages) for i in range(pp)]


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
