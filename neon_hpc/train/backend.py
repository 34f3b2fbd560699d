"""The megatron-core side of the trainer: model, DDP, optimizer, replayed forward, full weights.

What megatron-core does here, and what we do:

- model: ``neon_hpc.models.megatron.build_gpt_model`` (local spec), wrapped in megatron's
  ``DistributedDataParallel`` (grad buffers, DP/expert-DP reduction, SP norm grads via
  ``finalize_model_grads``);
- optimizer: megatron-core's ``get_megatron_optimizer`` (Adam, fp32, not distributed); on
  CPU with :mod:`.cpu_optimizer` (three CUDA literals replaced);
- forward: the packed micro-batch with its block-causal mask; labels go in, megatron's
  vocab-parallel cross-entropy comes out, so ``logp = -ce`` is exact under TP;
- router replay: megatron's ``RouterReplay`` instances, cleared before each model build
  (they accumulate in a class-level list otherwise), fed per micro-batch and cleared after.

Gradient scale: megatron's DDP divides every gradient by the DP size before summing over
DP (dense) or expert-DP (experts), i.e. it expects each rank's loss to be a *mean*.  Our loss
is a sum over the step's tokens divided by the global token count, so each rank backpropagates
``dp * (its token-loss sum) / global_tokens`` (see :meth:`Backend.loss_scale`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neon_hpc.models.config import ModelConfig
from neon_hpc.train.batch import MicroBatch, replay_tensors


@dataclass
class Layout:
    tp: int
    ep: int
    pp: int
    dp: int
    rank: int
    world: int
    tp_rank: int
    ep_rank: int
    dp_rank: int


@dataclass
class Backend:
    model_cfg: ModelConfig
    layout: Layout
    model: Any              # megatron GPTModel (this rank's shard)
    ddp: Any                # megatron DistributedDataParallel around it
    optimizer: Any          # megatron optimizer (ChainedOptimizer)
    replay: bool

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
        return self.model_cfg.num_layers     # qwen3_moe: every layer is MoE


def setup(model_cfg: ModelConfig, tp: int = 1, ep: int = 1, pp: int = 1, lr: float = 1e-3,
          weight_decay: float = 0.0, grad_clip: float = 1.0, replay: bool = True,
          seed: int = 1234, backend: str | None = None) -> Backend:
    """Initialise parallel state (from the torch.distributed env vars), build and wrap the model."""
    from neon_hpc.models import megatron as mm
    from neon_hpc.train import cpu_optimizer

    if pp != 1:
        raise NotImplementedError(f"train.pipeline_parallel={pp}: this trainer runs PP=1 (its own "
                                  f"micro-batch loop); set train.pipeline_parallel: 1")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    coords = mm.init_parallel(tp=tp, ep=ep, pp=pp, backend=backend, seed=seed)
    cpu_optimizer.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    model = mm.build_gpt_model(model_cfg, tp=tp, ep=ep, routing_replay=replay, seed=seed)
    if replay and len(RouterReplay.global_router_replay_instances) != model_cfg.num_layers:
        raise RuntimeError(f"expected {model_cfg.num_layers} RouterReplay instances after the build, found "
                           f"{len(RouterReplay.global_router_replay_instances)}")
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    _mark_tp_local_expert_grads(model, tp, ep)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay,
                              clip_grad=grad_clip, bf16=False, fp16=False, params_dtype=torch.float32,
                              use_distributed_optimizer=False, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp])
    layout = Layout(tp=tp, ep=ep, pp=pp, dp=ps.get_data_parallel_world_size(), rank=coords["rank"],
                    world=coords["world_size"], tp_rank=coords["tp_rank"], ep_rank=coords["ep_rank"],
                    dp_rank=coords["dp_rank"])
    return Backend(model_cfg=model_cfg, layout=layout, model=model, ddp=ddp, optimizer=optimizer, replay=replay)


def _mark_tp_local_expert_grads(model, tp: int, ep: int) -> int:
    """Make DDP sum expert grads over the TP ranks when TP > 1 and EP = 1 (expert TP = 1).

    Under sequence parallelism each TP rank routes its own slice of the tokens through its
    own full copy of the experts, so each rank's expert grads cover only its tokens.
    megatron-core 0.16.1 marks expert weights ``allreduce=False`` (-> reduced over the
    expert-data-parallel group, which here spans the TP ranks) only when EP > 1; with EP = 1
    they count as dense and are reduced over DP alone, i.e. never summed over TP (measured:
    TP=2 expert grads were each rank's half).  Marking them fixes the reduction; it must run
    before DDP and the optimizer are built.  Returns the number of parameters marked.
    """
    if tp == 1 or ep > 1:
        return 0
    n = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False
            n += 1
    return n


def teardown() -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from neon_hpc.models import megatron as mm
    RouterReplay.clear_global_router_replay_instances()
    mm.destroy_parallel()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def forward_logp(be: Backend, mb: MicroBatch, replay: bool | None = None) -> torch.Tensor:
    """Per-position logprob of each label token under the current weights, ``[1, S]``.

    With replay (default: whenever the backend was built with it and the micro-batch has
    routes) every MoE router takes the recorded experts instead of its own top-k.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    use_replay = (be.replay if replay is None else replay) and mb.routes is not None
    if use_replay and not be.replay:
        raise ValueError("replay requested but the model was built without routing replay (train.router_replay: off)")
    dev = _device()
    if use_replay:
        RouterReplay.set_replay_data([t.to(dev) for t in replay_tensors(
            mb.routes, be.layout.tp_rank, be.layout.tp, be.sequence_parallel)])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        ce = be.ddp(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev),
                    attention_mask=mb.attention_mask.to(dev), labels=mb.labels.to(dev))
    finally:
        if be.replay:
            # set_target_indices appends to a backward-replay list on every call: clear per micro-batch.
            RouterReplay.clear_global_indices()
            RouterReplay.clear_global_router_replay_action()
    return -ce.float()


# --------------------------------------------------------------------------------------
# full (TP=1, EP=1) state dict of the sharded model, for HF export of small models

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _partition_dims(model) -> dict[str, int | None]:
    """Parameter name -> the dim it is split along over TP (None: replicated on TP ranks)."""
    return {name: int(getattr(p, "partition_dim", 0)) if getattr(p, "tensor_model_parallel", False) else None
            for name, p in model.named_parameters()}


def full_state_dict(be: Backend) -> dict[str, torch.Tensor] | None:
    """The unsharded megatron state dict on global rank 0 (``None`` on the other ranks).

    Every rank sends its shard to rank 0 (fine for the small models exported this way; large
    ones go checkpoint -> ``tools/reshard.py``).  TP-split weights are concatenated along
    their partition dim (the fused QKV is split by query groups, so concatenation restores
    it; expert weights are not TP-split: expert TP is 1), local experts get global indices.
    """
    import torch.distributed as dist

    sd = {k: v.detach().cpu() for k, v in be.model.state_dict().items() if not k.endswith("_extra_state")}
    mine = (be.layout.tp_rank, be.layout.ep_rank, sd, _partition_dims(be.model))
    if be.layout.world == 1:
        gathered = [mine]
    else:
        gathered = [None] * be.layout.world if be.layout.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    if be.layout.rank != 0:
        return None
    by_tp = {t: (s, d) for t, _e, s, d in reversed(gathered)}
    by_ep = {e: s for _t, e, s, _d in reversed(gathered)}
    per_rank = be.model_cfg.num_experts // be.layout.ep
    out: dict[str, torch.Tensor] = {}
    sd0, dims0 = by_tp[0]
    for key in sd0:
        m = _EXPERT.match(key)
        if m:
            for e_rank, s in sorted(by_ep.items()):
                local = int(m.group(2))
                out[f"{m.group(1)}{e_rank * per_rank + local}{m.group(3)}"] = s[key]
            continue
        dim = dims0.get(key)
        if dim is None or be.layout.tp == 1:
            out[key] = sd0[key]
        else:
            out[key] = torch.cat([by_tp[t][0][key] for t in range(be.layout.tp)], dim=dim)
    return out


def load_full_state_dict(be: Backend, full: dict[str, torch.Tensor]) -> None:
    """Load an unsharded megatron state dict into this rank's shard (every rank calls it)."""
    from neon_hpc.models.convert import load_into_megatron, shard_for_rank
    load_into_megatron(be.model, shard_for_rank(full, be.model_cfg, tp_rank=be.layout.tp_rank,
                                                tp=be.layout.tp, ep_rank=be.layout.ep_rank, ep=be.layout.ep))


def load_initial_weights(be: Backend, path: str) -> None:
    """Start from an HF folder (``config.json`` + safetensors) or a torch_dist checkpoint (model only)."""
    from neon_hpc.models.convert import hf_to_megatron
    from neon_hpc.models.hf import read_hf_state_dict

    p = Path(path)
    if (p / "config.json").exists():
        load_full_state_dict(be, hf_to_megatron(read_hf_state_dict(p), be.model_cfg))
    elif (p / ".metadata").exists():
        from megatron.core import dist_checkpointing
        sharded = {"model": be.model.sharded_state_dict()}
        loaded = dist_checkpointing.load(sharded, str(p))
        be.model.load_state_dict(loaded["model"], strict=False)
    else:
        raise FileNotFoundError(f"model.init_checkpoint={path}: neither an HF folder (config.json) nor a "
                                f"torch_dist checkpoint (.metadata)")


def param_digest(be: Backend) -> float:
    """A cheap fingerprint of this rank's parameters (sum of |w|, float64), for logs and tests."""
    return float(sum(p.detach().double().abs().sum() for p in be.model.parameters()))


def reduce_sums(values: dict[str, float], group=None) -> dict[str, float]:
    """Sum a dict of floats over a process group (DP by default); identity without one."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    if group is None:
        from megatron.core import parallel_state as ps
        group = ps.get_data_parallel_group()
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=_device())  # NCCL: CUDA tensors
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
