"""The megatron-core side of the trainer: model, DDP, optimizer, replayed forward, full weights.

What megatron-core does here, and what we do:

- model: ``neon_hpc.models.megatron.build_gpt_model`` (local spec), wrapped in megatron's
  ``DistributedDataParallel`` (grad buffers, DP/expert-DP reduction, SP norm grads via
  ``finalize_model_grads``);
- optimizer: megatron-core's ``get_megatron_optimizer`` (Adam, fp32, not distributed); on
  CPU and CUDA without apex with :mod:`.optimizer_shim` (multi-tensor norm, clip and copy; CUDA literals on CPU);
- forward: the packed micro-batch with its block-causal mask; labels go in, the vocab-parallel
  cross-entropy comes out, so ``logp = -ce`` is exact under TP (computed over sequence chunks
  with the output layer, :mod:`.xent`: the logits are never held whole);
- router replay: megatron's ``RouterReplay`` instances, cleared before each model build
  (they accumulate in a class-level list otherwise), fed per micro-batch and cleared after;
  a pipeline stage holds the instances of its own MoE layers and gets those layers' routes;
- model chunks: with ``train.virtual_pipeline_stages: V > 1`` each stage holds V chunks
  (``Backend.models`` / ``ddps``: a GPTModel and a DDP each, one optimizer over all), layers
  as :func:`neon_hpc.train.layout.chunk_layers` assigns them;
- micro-batches: megatron-core's pipeline schedules (:func:`forward_backward`): no
  pipelining for PP = 1, 1F1B for PP > 1, interleaved 1F1B with V > 1 chunks (one data
  iterator per chunk over the same micro-batches), micro-batches in the assignment's order, each stage's
  activation shape exchanged per micro-batch (``variable_seq_lengths``: packed micro-batches
  differ in length).  On CPU the stages talk over gloo through megatron's ordered
  ``isend``/``irecv`` path (``batch_p2p_comm=False``; ``batch_isend_irecv`` hangs on gloo) and
  :mod:`neon_hpc.models.cpu_shim` covers the schedules' CUDA literals.

Gradient scale: megatron's DDP divides every gradient by the DP size before summing over
DP (dense) or expert-DP (experts), i.e. it expects each rank's loss to be a *mean*.  Our loss
is a sum over the step's tokens divided by the global token count, so each rank backpropagates
``dp * (its token-loss sum) / global_tokens`` (see :meth:`Backend.loss_scale`).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, get_args, get_type_hints

import numpy as np
import torch
import torch.distributed as dist

from neon_hpc.arch import get as get_architecture
from neon_hpc.arch.rules import tp_join
from neon_hpc.balance.pipeline import microbatch_group_size
from neon_hpc.config.model import ModelConfig
from neon_hpc.config.train import TrainConfig
from neon_hpc.models import megatron as mm, recompute as rc
from neon_hpc.models.convert import hf_to_megatron, load_into_megatron, shard_for_rank
from neon_hpc.models.hf import read_hf_state_dict
from neon_hpc.train import optimizer_shim, xent
from neon_hpc.train.batch import MicroBatch, replay_rows
from neon_hpc.train.layout import chunk_layers, stage_layers


@dataclass
class RankLayout:
    """The trainer's parallel layout as one rank sees it: the group sizes and its coordinates in them."""

    tp: int
    ep: int
    pp: int
    dp: int
    rank: int
    world: int
    tp_rank: int
    ep_rank: int
    dp_rank: int
    pp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    vpp: int = 1
    layer_offset: int = 0            # global index of this stage's first decoder layer (chunk 0's under V > 1)
    num_local_layers: int = 0        # decoder layers on this stage (chunk 0's under V > 1)
    chunks: tuple = ()               # V > 1: ((first global layer, layers), ...) per model chunk

    @property
    def chunk_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(first global layer, layers)`` of each model chunk on this stage (one without V > 1)."""
        return tuple(self.chunks) or ((self.layer_offset, self.num_local_layers),)

    def first_chunk(self, c: int) -> bool:
        """Chunk ``c`` embeds the tokens (chunk 0 of the first stage)."""
        return self.first_stage and c == 0

    def last_chunk(self, c: int) -> bool:
        """Chunk ``c`` holds the final norm and output layer (the last chunk of the last stage)."""
        return self.last_stage and c == len(self.chunk_ranges) - 1

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def as_record(self) -> dict[str, int]:
        """What a checkpoint records; two layouts with equal records run the same shards."""
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "cp": self.cp, "dp": self.dp, "vpp": self.vpp,
                "world": self.world}


class Backend:
    """This rank's model: one megatron ``GPTModel`` per model chunk (one without virtual stages).

    ``models[c]`` / ``ddps[c]``: chunk ``c`` and its ``DistributedDataParallel`` (each chunk has
    its own grad buffer, as in megatron's training loop); ``optimizer``: one megatron optimizer
    over every chunk.  ``model`` / ``ddp`` name the single chunk of a layout without virtual
    stages and refuse under V > 1 (code that means "the model" must then say which chunk).
    ``replay_spans[c]``: the ``[lo, hi)`` slice of ``RouterReplay.global_router_replay_instances``
    built for chunk ``c``'s MoE layers.
    """

    def __init__(self, model_cfg: ModelConfig, layout: RankLayout, model: Any = None, ddp: Any = None,
                 optimizer: Any = None, replay: bool = True, models: list | None = None,
                 ddps: list | None = None, replay_spans: list[tuple[int, int]] | None = None,
                 precision: str = "fp32", recompute: str = "none") -> None:
        self.model_cfg, self.layout, self.optimizer, self.replay = model_cfg, layout, optimizer, replay
        self.precision, self.recompute = precision, recompute
        self.models = list(models) if models is not None else [model]
        self.ddps = list(ddps) if ddps is not None else [ddp]
        self.replay_spans = replay_spans

    def _single(self, what: str, items: list):
        if len(items) != 1:
            raise RuntimeError(f"this rank holds {len(items)} model chunks (train.virtual_pipeline_stages="
                               f"{len(items)}): use be.{what}s[c] for chunk c, not be.{what}")
        return items[0]

    @property
    def model(self):
        return self._single("model", self.models)

    @property
    def ddp(self):
        return self._single("ddp", self.ddps)

    def zero_grad(self) -> None:
        """Zero every chunk's grad buffer and the optimizer's grads (before a step's micro-batches)."""
        for d in self.ddps:
            d.zero_grad_buffer()
        self.optimizer.zero_grad()

    def finalize_grads(self) -> None:
        """megatron's ``finalize_model_grads`` over every chunk (DP/expert-DP reduction, SP norms)."""
        from megatron.core.distributed import finalize_model_grads  # deferred: heavy (megatron)
        finalize_model_grads(self.ddps)

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.tp > 1

    @property
    def pad_multiple(self) -> int:
        return self.layout.tp if self.sequence_parallel else 1

    def loss_scale(self, global_tokens: float) -> float:
        """The ``denom`` for :func:`~neon_hpc.train.loss.policy_loss` on this rank."""
        return float(global_tokens) / self.layout.dp

    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids())

    def moe_layer_ids(self) -> list[int]:
        """Global indices of the decoder layers that route (rows of a trajectory's routes)."""
        return get_architecture(self.model_cfg.arch).moe_layers(self.model_cfg)   # dense layers do not route

    def route_rows(self, chunk: int | None = None) -> list[int]:
        """Which rows of the ``[S, moe_layers, k]`` routes this pipeline stage's routers replay.

        ``chunk``: only model chunk ``chunk``'s layers; ``None``: every chunk's, in build order
        (chunk 0 first), which is the order of the ``RouterReplay`` instances.
        """
        ranges = self.layout.chunk_ranges
        chunks = range(len(ranges)) if chunk is None else [chunk]
        ids = self.moe_layer_ids()
        return [i for c in chunks for i, layer in enumerate(ids)
                if ranges[c][0] <= layer < ranges[c][0] + ranges[c][1]]


def pipeline_overrides(pp: int, first_stage_layers: int = 0, last_stage_layers: int = 0,
                       vpp: int = 1, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """TransformerConfig fields for ``pp`` stages of ``vpp`` model chunks each (empty for PP = 1);
    ``dtype``: the activations the stages exchange (the parameters' dtype)."""
    if pp == 1:
        return {}
    return dict(pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
                variable_seq_lengths=True,                 # packed micro-batches differ in length
                batch_p2p_comm=torch.cuda.is_available(),  # gloo: ordered isend/irecv, not batch_isend_irecv
                num_layers_in_first_pipeline_stage=first_stage_layers or None,
                num_layers_in_last_pipeline_stage=last_stage_layers or None,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)


# the values are the config's (config/train.py: TrainConfig.precision / .recompute), written once there
PRECISIONS = tuple(p for p in get_args(get_type_hints(TrainConfig)["precision"]) if p != "auto")
RECOMPUTE = get_args(get_type_hints(TrainConfig)["recompute"])


def resolve_precision(precision: str) -> str:
    """``train.precision`` as run: ``auto`` is bf16 on CUDA and fp32 on CPU (where bf16 matmuls
    are emulated and slower than fp32)."""
    if precision == "auto":
        return "bf16" if torch.cuda.is_available() else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r}: one of auto, {', '.join(PRECISIONS)}")
    return precision


def precision_overrides(precision: str) -> dict[str, Any]:
    """TransformerConfig fields of a precision: bf16 parameters and activations (megatron's
    ``Float16Module`` wraps the model; the optimizer keeps fp32 main parameters), the router's
    logits and probabilities in fp32 (with fp32 parameters they are anyway)."""
    if precision == "bf16":
        return dict(bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32")
    return {}


def recompute_overrides(recompute: str) -> dict[str, Any]:
    """TransformerConfig fields of ``train.recompute``: ``full`` keeps only each layer's input and
    recomputes the layer in backward (megatron's uniform method, one layer per checkpoint);
    ``selective`` recomputes the MoE layer (router, dispatch and experts: most of a MoE model's
    activations) and the norms (megatron's ``moe`` / ``layernorm`` modules; attention is a fused
    kernel that stores no score matrix, so there is little to gain there).  Either way the
    recomputed forward sees the micro-batch's attention layout and replayed routes
    (:mod:`neon_hpc.models.recompute`)."""
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["moe", "layernorm"])
    if recompute != "none":
        raise ValueError(f"train.recompute={recompute!r}: one of {', '.join(RECOMPUTE)}")
    return {}


# Chunk c > 0 of a stage is initialised from seed + CHUNK_SEED_STRIDE * c (chunk 0 from the seed
# itself, as without virtual stages), so two chunks of one stage never start as copies.
CHUNK_SEED_STRIDE = 7919


def setup(model_cfg: ModelConfig, tp: int = 1, ep: int = 1, pp: int = 1, lr: float = 1e-3,
          weight_decay: float = 0.0, grad_clip: float = 1.0, replay: bool = True,
          seed: int = 1234, backend: str | None = None, pp_first_stage_layers: int = 0,
          pp_last_stage_layers: int = 0, vpp: int = 1, cp: int = 1, precision: str = "fp32",
          recompute: str = "none", experts: str | None = None) -> Backend:
    """Initialise parallel state (from the torch.distributed env vars), build and wrap the model.

    ``cp`` is recorded in the layout only: CP ranks are megatron DP ranks (the CP attention of
    :mod:`neon_hpc.models.cp_attention` exchanges K/V itself), so megatron's DP size is dp*cp.
    ``vpp > 1``: that many model chunks per stage (interleaved 1F1B), each its own GPTModel and
    DDP, with layers as :func:`neon_hpc.train.layout.chunk_layers` assigns them.
    ``precision`` (``auto`` | ``bf16`` | ``fp32``): with bf16 each chunk is megatron's
    ``Float16Module`` (bf16 parameters and activations, fp32 logits out) inside DDP (fp32 gradient
    buffers), and the optimizer is megatron's mixed-precision one (fp32 main parameters and
    Adam state; no loss scaling for bf16).  ``recompute``: :func:`recompute_overrides`.
    ``experts``: :func:`neon_hpc.models.megatron.build_gpt_model`'s.
    """

    per_stage = stage_layers(model_cfg.num_layers, pp, pp_first_stage_layers, pp_last_stage_layers)
    if vpp > 1 and pp == 1:
        raise ValueError(f"train.virtual_pipeline_stages={vpp} needs train.pipeline_parallel > 1")
    expected = chunk_layers(per_stage, vpp)        # ValueError naming the sizes if V does not divide
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    precision = resolve_precision(precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    overrides = {**precision_overrides(precision), **recompute_overrides(recompute),
                 **pipeline_overrides(pp, pp_first_stage_layers, pp_last_stage_layers, vpp, dtype)}
    coords = mm.init_parallel(tp=tp, ep=ep, pp=pp, backend=backend, seed=seed, vpp=vpp)
    optimizer_shim.apply()
    if recompute != "none":
        rc.install()
    # deferred: heavy (megatron)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from neon_hpc.models.experts import GroupedExperts  # deferred: heavy (megatron)

    RouterReplay.clear_global_router_replay_instances()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    models, ddps, spans, built = [], [], [], []
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    for c in range(vpp):
        lo = len(RouterReplay.global_router_replay_instances)
        model = mm.build_gpt_model(model_cfg, tp=tp, ep=ep, routing_replay=replay,
                                   seed=seed + CHUNK_SEED_STRIDE * c, vp_stage=c if vpp > 1 else None,
                                   experts=experts, **overrides)
        spans.append((lo, len(RouterReplay.global_router_replay_instances)))
        built.append((get_transformer_layer_offset(model.config, vp_stage=c if vpp > 1 else None),
                      len(model.decoder.layers)))
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        _mark_tp_local_expert_grads(model, tp, ep)
        xent.install(model)            # the last stage's CE over sequence chunks (train/xent.py)
        models.append(model)
        wrapped = Float16Module(model.config, model) if precision == "bf16" else model
        ddps.append(DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=wrapped))
        for m in model.modules():     # the experts' weight grads straight into DDP's main_grad (no per-expert hook)
            if isinstance(m, GroupedExperts):
                m.grads_into_main_grad = not ddp_cfg.overlap_grad_reduce
    if built != expected[pp_rank]:
        raise RuntimeError(f"pipeline stage {pp_rank}: megatron built (first layer, layers) {built} per model "
                           f"chunk, train/layout.py expects {expected[pp_rank]} (the two rules disagree)")
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay,
                              clip_grad=grad_clip, bf16=precision == "bf16", fp16=False, params_dtype=dtype,
                              use_distributed_optimizer=False, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    optimizer = get_megatron_optimizer(opt_cfg, ddps)
    fuse_torch_adam(optimizer)
    (offset, n_local) = built[0]
    layout = RankLayout(tp=tp, ep=ep, pp=pp, dp=ps.get_data_parallel_world_size(), rank=coords["rank"],
                    world=coords["world_size"], tp_rank=coords["tp_rank"], ep_rank=coords["ep_rank"],
                    dp_rank=coords["dp_rank"], pp_rank=pp_rank, vpp=vpp, cp=cp,
                    cp_rank=coords["dp_rank"] % cp, layer_offset=offset,
                    num_local_layers=n_local, chunks=tuple(built) if vpp > 1 else ())
    be = Backend(model_cfg=model_cfg, layout=layout, optimizer=optimizer, replay=replay, models=models,
                 ddps=ddps, replay_spans=spans, precision=precision, recompute=recompute)
    for c, (lo, hi) in enumerate(spans):
        if replay and hi - lo != len(be.route_rows(c)):
            raise RuntimeError(f"expected {len(be.route_rows(c))} RouterReplay instances for model chunk {c} "
                               f"on pipeline stage {pp_rank} after the build, found {hi - lo}")
    return be


def fuse_torch_adam(optimizer) -> int:
    """Run torch's Adam as its fused kernel where megatron fell back to torch's optimizer.

    Without Transformer Engine or apex megatron builds ``torch.optim.Adam(W)`` with torch's
    defaults: the per-tensor loop on CPU, ``foreach`` on CUDA.  The fused kernel (one pass per
    parameter group; CPU and CUDA) does the same update.  It is a flag of each param group,
    read at every step, and saved with the optimizer's state, so a checkpoint resumes on the
    path it was trained with.  TE's and apex's fused optimizers are left alone.  Returns the
    number of param groups switched."""
    n = 0
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in chained:
        inner = getattr(opt, "optimizer", None)
        if type(inner) in (torch.optim.Adam, torch.optim.AdamW):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
                n += 1
    return n


def _mark_tp_local_expert_grads(model, tp: int, ep: int) -> int:
    """Make DDP sum expert grads over the TP ranks when TP > 1 and EP = 1 (expert TP = 1).

    Under sequence parallelism each TP rank routes its own slice of the tokens through its
    own full copy of the experts, so each rank's expert grads cover only its tokens.
    megatron-core 0.16.1 marks expert weights ``allreduce=False`` (-> reduced over the
    expert-data-parallel group, which here spans the TP ranks) only when EP > 1; with EP = 1
    they count as dense and are reduced over DP alone, i.e. never summed over TP (measured:
    TP=2 expert grads were each rank's half).  Marking them fixes the reduction; it must run
    before DDP and the optimizer are built.  Returns the number of parameters marked.

    At TP = 1 the mark changes no reduction (the expert-data-parallel group is then the DP
    group) but it is applied all the same: marked expert weights get their own optimizer
    (megatron's ``ChainedOptimizer`` of dense + expert), so every layout has the same optimizer
    structure and checkpoint keys, and an EP = 2 checkpoint loads at EP = 1 (unmarked, a single
    optimizer's keys lack the ``chained_N.`` prefix and the load fails).
    """
    if ep > 1:
        return 0
    n = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False
            n += 1
    return n


def teardown() -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay  # deferred: heavy (megatron)

    RouterReplay.clear_global_router_replay_instances()
    mm.destroy_parallel()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def forward_logp(be: Backend, mb: MicroBatch, replay: bool | None = None, chunk: int = 0) -> torch.Tensor:
    """Model chunk ``chunk``'s forward of one micro-batch: on the last chunk of the last stage
    the per-position logprob of each label token under the current weights, ``[1, S]``; on
    the others their hidden states (the input comes from ``set_input_tensor``, as megatron's
    schedules set it).

    With replay (default: whenever the backend was built with it and the micro-batch has
    routes) every MoE router of the chunk takes the recorded experts instead of its own top-k.
    """
    # deferred: heavy (megatron)
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    use_replay = (be.replay if replay is None else replay) and mb.routed_experts is not None
    if use_replay and not be.replay:
        raise ValueError("replay requested but the model was built without routing replay "
                         "(offpolicy.replay_trainer: off)")
    dev = _device()
    routers = []
    if be.replay:
        lo, hi = be.replay_spans[chunk] if be.replay_spans else (0, len(RouterReplay.global_router_replay_instances))
        routers = RouterReplay.global_router_replay_instances[lo:hi]
    if use_replay:
        rows = replay_rows(mb, be.layout.tp_rank, be.layout.tp, be.sequence_parallel,
                           layers=be.route_rows(chunk))
        for router, t in zip(routers, rows, strict=True):
            router.set_target_indices(t.to(dev))      # on the device already after batch.to_device
            router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        with xent.deferred(be.layout.last_chunk(chunk)):    # logits never whole: CE in sequence chunks
            out = be.ddps[chunk](input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev),
                                 attention_mask=None if mb.attention_mask is None else mb.attention_mask.to(dev),
                                 labels=mb.labels.to(dev))
    finally:
        # set_target_indices appends to a backward-replay list on every call: clear per micro-batch
        # (no recompute: the backward, which 1F1B runs later, needs no replay)
        for router in routers:
            router.clear_indices()
            router.clear_router_replay_action()
    # the last chunk of the last stage returns the per-token cross-entropy; the others hidden states
    return -out.float() if be.layout.last_chunk(chunk) else out


def forward_backward(be: Backend, microbatches: Sequence[MicroBatch], loss_fn,
                     forward_context=None, seq_length: int | None = None) -> dict[str, float]:
    """Forward and backward every micro-batch through megatron-core's schedule; returns summed terms.

    ``loss_fn(logp [1, S], mb) -> (loss, terms)`` runs on the last pipeline stage only (the
    others return ``{}``; :func:`reduce_step_sums` spreads the last stage's sums).  megatron
    divides each micro-batch's loss by the number of micro-batches (its loss is a mean); ours
    is already a sum over the step's tokens divided by their global count, so the loss handed
    to the schedule is multiplied by that number first.  ``forward_context(j)``, if given, is
    entered around micro-batch ``j``'s forward (its backward may run later, after other
    forwards: 1F1B), on every model chunk.  With V model chunks per stage the schedule is
    megatron's interleaved 1F1B: each chunk reads the micro-batches in the assignment's order from its
    own iterator.  ``microbatches`` is read lazily, item ``j`` when the schedule needs it (a
    :class:`~neon_hpc.train.prefetch.Prefetched` builds them meanwhile); ``seq_length`` (the
    longest, default: read from every item) then spares waiting for all of them.  The terms are
    summed on the device in float64 and read back in one transfer at the end (the same sums
    as adding each term's ``float`` on the host).  Gradients are not finalised here (``finalize_model_grads_func`` stays
    unset): the caller does it once after this returns (:meth:`Backend.finalize_grads`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func  # deferred: heavy (megatron)


    n = len(microbatches)
    if n == 0:
        return {}
    sums: dict[str, Any] = {}
    chunk_of = {id(d): c for c, d in enumerate(be.ddps)}
    vpp = len(be.ddps)

    def step(data_iter, model):
        j, mb = next(data_iter)
        c = chunk_of[id(model)]
        with (forward_context(j) if forward_context is not None else contextlib.nullcontext()):
            out = forward_logp(be, mb, chunk=c)

        def loss_func(logp):
            loss, terms = loss_fn(logp, mb)
            _accumulate(sums, terms)
            # 3-tuple: megatron divides by the token count given (1) and by n (undone here)
            return loss * n, torch.ones((), dtype=torch.int), {}
        return out, loss_func

    if vpp > 1:
        g = microbatch_group_size(n, be.layout.pp)
        for m in be.models:
            m.config.microbatch_group_size_per_vp_stage = g
        data = [((j, microbatches[j]) for j in range(n)) for _ in range(vpp)]
    else:
        data = ((j, microbatches[j]) for j in range(n))
    if seq_length is None:
        seq_length = max(mb.seq_len for mb in microbatches)
    get_forward_backward_func()(forward_step_func=step, data_iterator=data, model=be.ddps,
                                num_microbatches=n, seq_length=seq_length, micro_batch_size=1, forward_only=False)
    return _read_back(sums)


def _accumulate(sums: dict[str, Any], terms: dict[str, Any]) -> None:
    """``sums[k] += terms[k]``: tensors stay on the device (float64), no read-back here."""
    with torch.no_grad():                # no graph for the bookkeeping: no ``detach`` (or ``view``) per term
        for k, v in terms.items():
            if isinstance(v, torch.Tensor):
                v = v.double()
                v = v if v.dim() == 0 else v.reshape(())
            else:
                v = float(v)
            sums[k] = v if k not in sums else sums[k] + v


def _read_back(sums: dict[str, Any]) -> dict[str, float]:
    """The summed terms as floats: one device-to-host transfer for all of them."""
    keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in sums.items() if not isinstance(v, torch.Tensor)}
    if keys:
        out.update(zip(keys, torch.stack([sums[k] for k in keys]).tolist()))
    return {k: out[k] for k in sums}


def reduce_step_sums(be: Backend, sums: dict[str, float]) -> dict[str, float]:
    """Sum per-step terms over DP, then hand the last pipeline stage's result to every stage."""
    out = reduce_sums(sums)
    if be.layout.pp == 1:
        return out
    from megatron.core import parallel_state as ps  # deferred: heavy (megatron)
    group = ps.get_pipeline_model_parallel_group()
    box = [out if be.layout.last_stage else None]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return box[0]


# --------------------------------------------------------------------------------------
# full (TP=1, EP=1) state dict of the sharded model, for HF export of small models

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "output_layer.")


def _renumber_layer(key: str, shift: int) -> str:
    """``decoder.layers.L.*`` -> ``decoder.layers.(L+shift).*`` (other keys unchanged)."""
    m = _LAYER.match(key)
    return key if m is None else f"decoder.layers.{int(m.group(1)) + shift}.{key[m.end():]}"


def stage_state_dict(full: dict[str, torch.Tensor], lay: RankLayout, chunk: int = 0) -> dict[str, torch.Tensor]:
    """The part of a full (all-layer) state dict model chunk ``chunk`` of this pipeline stage
    holds (the stage itself without virtual stages), in its local numbering."""
    out = {}
    lo, n = lay.chunk_ranges[chunk]
    hi = lo + n
    for key, t in full.items():
        m = _LAYER.match(key)
        if m:
            if lo <= int(m.group(1)) < hi:
                out[_renumber_layer(key, -lo)] = t
        elif key.startswith(_FIRST_STAGE):
            if lay.first_chunk(chunk):
                out[key] = t
        elif key.startswith(_LAST_STAGE):
            if lay.last_chunk(chunk):
                out[key] = t
        else:
            out[key] = t
    return out


def _partition_dims(model) -> dict[str, int | None]:
    """Parameter name -> the dim it is split along over TP (None: replicated on TP ranks)."""
    return {name: int(getattr(p, "partition_dim", 0)) if getattr(p, "tensor_model_parallel", False) else None
            for name, p in model.named_parameters()}


def host_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``state``, never views of live parameters (a publish written beside the next
    optimizer step reads them): CUDA tensors go into pinned memory with ``non_blocking`` and one
    wait at the end (not one blocking pageable copy each); CPU tensors are cloned."""
    out, waits = {}, False
    for k, v in state.items():
        v = v.detach()
        if v.is_cuda:
            h = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            h.copy_(v, non_blocking=True)
            waits = True
        else:
            h = v.clone()
        out[k] = h
    if waits:
        torch.cuda.synchronize()        # one wait for every copy
    return out


def full_state_dict(be: Backend) -> dict[str, torch.Tensor] | None:
    """The unsharded megatron state dict on global rank 0 (``None`` on the other ranks), as host
    copies (:func:`host_copies`: a snapshot, not views of the live parameters).

    Every rank sends its shard to rank 0 (fine for the small models exported this way; large
    ones go checkpoint -> ``tools/reshard.py``).  TP-split weights are concatenated along
    their partition dim (the fused QKV is split by query groups, so concatenation restores
    it; expert weights are not TP-split: expert TP is 1), local experts get global indices.
    """

    lay = be.layout
    sd: dict[str, torch.Tensor] = {}
    dims: dict[str, int | None] = {}
    for model, (shift, _n) in zip(be.models, lay.chunk_ranges, strict=True):
        # stages (and model chunks) number their layers from 0: make them global
        sd.update({_renumber_layer(k, shift): v for k, v in model.state_dict().items()
                   if not k.endswith("_extra_state")})
        dims.update({_renumber_layer(k, shift): d for k, d in _partition_dims(model).items()})
    sd = host_copies(sd)
    mine = (lay.tp_rank, lay.ep_rank, sd, dims)
    if lay.world == 1:
        gathered = [mine]
    else:
        gathered = [None] * lay.world if lay.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    if lay.rank != 0:
        return None
    per_rank = be.model_cfg.num_experts // lay.ep
    by_tp: dict[int, dict[str, torch.Tensor]] = {}
    all_dims: dict[str, int | None] = {}
    out: dict[str, torch.Tensor] = {}
    for t, e_rank, s, d in reversed(gathered):     # lowest rank last: its copy wins
        all_dims.update(d)
        for key, v in s.items():
            m = _EXPERT.match(key)
            if m:
                out[f"{m.group(1)}{e_rank * per_rank + int(m.group(2))}{m.group(3)}"] = v
            else:
                by_tp.setdefault(t, {})[key] = v
    for key, v0 in by_tp[0].items():
        dim = all_dims.get(key)
        if dim is None or lay.tp == 1:
            out[key] = v0
        elif get_architecture(be.model_cfg.arch).tp_kind(key) == "swiglu":   # per rank [gate; up] (dense/shared MLPs)
            out[key] = tp_join([by_tp[t][key] for t in range(lay.tp)], "swiglu")
        else:
            out[key] = torch.cat([by_tp[t][key] for t in range(lay.tp)], dim=dim)
    return out


def load_full_state_dict(be: Backend, full: dict[str, torch.Tensor]) -> None:
    """Load an unsharded megatron state dict into this rank's shard (every rank calls it)."""
    for c, model in enumerate(be.models):
        load_into_megatron(model, shard_for_rank(stage_state_dict(full, be.layout, c), be.model_cfg,
                                                 tp_rank=be.layout.tp_rank, tp=be.layout.tp,
                                                 ep_rank=be.layout.ep_rank, ep=be.layout.ep))


def init_checkpoint_kind(path: str | Path) -> str:
    """``"torch_dist"`` or ``"hf"``: what ``model.init_checkpoint`` points at; FileNotFoundError if neither.

    ``.metadata`` decides first: a neon-hpc trainer checkpoint is torch_dist and also carries
    the model's ``config.json`` (for reshard), but no safetensors.
    """
    p = Path(path)
    if (p / ".metadata").exists():
        return "torch_dist"
    if (p / "config.json").exists():
        return "hf"
    raise FileNotFoundError(f"model.init_checkpoint={path}: neither a torch_dist checkpoint (.metadata) nor an "
                            f"HF folder (config.json + safetensors)")


def load_initial_weights(be: Backend, path: str) -> None:
    """Start from an HF folder (``config.json`` + safetensors) or a torch_dist checkpoint (model only)."""

    p = Path(path)
    kind = init_checkpoint_kind(p)
    if kind == "hf":
        load_full_state_dict(be, hf_to_megatron(read_hf_state_dict(p), be.model_cfg))
    else:
        from megatron.core import dist_checkpointing  # deferred: heavy (megatron)

        # deferred: cycle (neon_hpc.train.checkpoint imports this module)
        from neon_hpc.train.checkpoint import refuse_untrusted
        refuse_untrusted(p)          # a foreign checkpoint: its pickles could run code in megatron's load
        loaded = dist_checkpointing.load(model_sharded_state_dict(be), str(p))
        load_model_state(be, loaded)


def model_keys(be: Backend) -> list[str]:
    """Top-level keys of the model chunks in a checkpoint's sharded state dict: ``model`` for one
    chunk, ``model0 .. model{V-1}`` for V (megatron-LM's names).  torch_dist matches tensors by
    their global sharded keys, not by these, so either loads into the other."""
    return ["model"] if len(be.models) == 1 else [f"model{c}" for c in range(len(be.models))]


def model_sharded_state_dict(be: Backend) -> dict[str, Any]:
    """``{model_key: chunk.sharded_state_dict()}`` for every model chunk (:func:`model_keys`)."""
    return {k: m.sharded_state_dict() for k, m in zip(model_keys(be), be.models)}


def load_model_state(be: Backend, loaded: dict[str, Any]) -> None:
    """Load each chunk's part of a ``dist_checkpointing.load`` result of :func:`model_sharded_state_dict`."""
    for k, m in zip(model_keys(be), be.models):
        m.load_state_dict(loaded[k], strict=False)


def param_digest(be: Backend) -> float:
    """A cheap fingerprint of this rank's parameters (sum of |w|, float64), for logs and tests."""
    return tensor_digest([p.detach() for p in parameters(be)])


def parameters(be: Backend) -> list[torch.Tensor]:
    """This rank's parameters, in the order :func:`param_digest` sums them."""
    return [p for m in be.models for p in m.parameters()]


def tensor_digest(tensors: list[torch.Tensor]) -> float:
    """Sum of |x| over ``tensors`` in float64: one multi-tensor kernel and one read-back (on CUDA,
    one host sync, not one per tensor); the same figure for a host copy of the same values."""
    if not tensors:
        return 0.0
    return float(torch.stack(torch._foreach_norm(tensors, 1, dtype=torch.float64)).sum())


def reduce_sums(values: dict[str, float], group=None) -> dict[str, float]:
    """Sum a dict of floats over a process group (DP by default); identity without one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    if group is None:
        from megatron.core import parallel_state as ps  # deferred: heavy (megatron)
        group = ps.get_data_parallel_group()
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_device())  # NCCL: CUDA tensors
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
