"""The policy model in its megatron-core home: GPTModel from the local layer spec.

One :class:`~neon_hpc.config.model.ModelConfig` becomes a ``TransformerConfig`` (and layer
spec) that matches the HF model of its architecture number for number; the architecture's
part (attention, router, dense layers) is its folder's ``megatron.py``
(``neon_hpc/arch/<name>/megatron.py``, named by :attr:`~neon_hpc.arch.base.Architecture.megatron_module`).

Parallel layout: ``tp`` shards attention/embeddings, ``ep`` shards experts (expert TP is 1:
each expert lives whole on one rank), sequence parallelism is on whenever ``tp > 1`` (megatron
requires it for MoE with TP).  On CPU everything runs on gloo with :mod:`.cpu_shim`.
"""

from __future__ import annotations

import datetime
import importlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from neon_hpc import arch
from neon_hpc.config.model import ModelConfig
from neon_hpc.models import cpu_shim
from neon_hpc.models.core_attention import SDPACoreAttention
from neon_hpc.util.netutil import free_port


def init_parallel(tp: int = 1, ep: int = 1, pp: int = 1, backend: str = "gloo",
                  seed: int | None = None, vpp: int = 1) -> dict[str, int]:
    """Initialise torch.distributed and megatron's parallel state; returns this rank's coordinates.

    The process group comes from the usual env vars (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, as set by torchrun, ``srun`` wrappers or our launcher); without them a
    single-process group is created on a free localhost port.  Calling it again with the same
    sizes is a no-op; with different sizes it rebuilds megatron's groups.  ``vpp > 1``: that
    many model chunks per pipeline stage (megatron's virtual pipeline size: the interleaved
    schedule).
    """
    cpu_shim.apply()
    # deferred: heavy (megatron)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=10)
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            # one process, its own rendezvous: nothing written to os.environ, which the
            # process's children (a test's subprocesses, a launcher's workers) inherit
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    world = dist.get_world_size()
    if world % (tp * pp) or world % (ep * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp={tp * pp} and ep*pp={ep * pp}; "
                         f"start tp*dp*pp processes (and make ep divide tp*dp)")
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size() == tp
                and ps.get_expert_model_parallel_world_size() == ep
                and ps.get_pipeline_model_parallel_world_size() == pp
                and (ps.get_virtual_pipeline_model_parallel_world_size() or 1) == vpp)
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    model_parallel_cuda_manual_seed(1234 if seed is None else seed)
    return {"rank": dist.get_rank(), "world_size": world,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "ep_rank": ps.get_expert_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "dp_rank": ps.get_data_parallel_rank()}


def destroy_parallel() -> None:
    """Tear down megatron's groups and the torch.distributed process group."""
    from megatron.core import parallel_state as ps  # deferred: heavy (megatron)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def megatron_builders(name: str):
    """The megatron module of architecture ``name`` (its folder's ``megatron.py``:
    ``transformer_config``, ``layer_spec``)."""
    return importlib.import_module(arch.get(name).megatron_module)


def transformer_config(cfg: ModelConfig, tp: int = 1, ep: int = 1, routing_replay: bool = False,
                       **overrides: Any):
    """The ``TransformerConfig`` equivalent to ``cfg``; ``overrides`` set any other field.

    The fields every architecture shares are here; the megatron module of ``cfg.arch`` adds its own
    (attention kind, router, dense layers) and picks the config class."""
    cpu_shim.apply()
    builders = megatron_builders(cfg.arch)
    if cfg.num_experts % ep:
        raise ValueError(f"expert_parallel={ep} must divide model.num_experts={cfg.num_experts}")
    if cfg.vocab_size % tp:
        raise ValueError(f"tensor_parallel={tp} must divide model.vocab_size={cfg.vocab_size}")
    base: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_load_balancing_type="none",  # the loss adds an aux term itself if it wants one
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,                # megatron's grouped experts need TE; ours: models/experts.py
        moe_permute_fusion=False,
        moe_enable_routing_replay=routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        init_method_std=0.02,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp > 1,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    return builders.transformer_config(cfg, tp, ep, routing_replay, base, overrides)


def layer_spec(cfg: ModelConfig, tcfg, vp_stage: int | None = None):
    """The local-spec layer spec of ``cfg.arch`` (one spec, or a block spec with per-layer specs
    of model chunk ``vp_stage``'s layers under the interleaved schedule). Multi-latent attention's
    core attention is :class:`~neon_hpc.models.core_attention.SDPACoreAttention` (fused SDPA)."""
    spec = megatron_builders(cfg.arch).layer_spec(cfg, tcfg, vp_stage=vp_stage)
    if arch.get(cfg.arch).attention == "mla":
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_gpt_model(cfg: ModelConfig, tp: int = 1, ep: int = 1, routing_replay: bool = False,
                    seed: int | None = None, vp_stage: int | None = None, experts: str | None = None,
                    dispatch: str = "device", **overrides: Any):
    """This rank's shard of the GPTModel (needs :func:`init_parallel` first).

    ``seed`` (default ``cfg.seed``) reseeds megatron's RNG tracker so that a fresh model's
    initial weights are reproducible.  ``vp_stage``: which of this stage's model chunks to
    build under the interleaved schedule (``init_parallel(vpp=V)`` and the override
    ``virtual_pipeline_model_parallel_size=V``); only chunk 0 of the first stage embeds and
    only chunk V-1 of the last stage has the output layer.  ``experts``: ``"grouped"`` (one
    grouped GEMM per projection, :mod:`.experts`) or ``"sequential"`` (megatron's loop); default
    :func:`neon_hpc.models.experts.expert_impl`, what this device can run for the parameters'
    dtype.  ``dispatch``: ``"device"`` (the MoE token dispatcher of :mod:`.dispatch`: a device
    permutation, no host sync at expert TP x EP = 1) or ``"megatron"`` (its alltoall dispatcher).
    Same parameters either way.
    """
    cpu_shim.apply()
    # deferred: heavy (megatron)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is not initialised; call "
                           "neon_hpc.models.megatron.init_parallel(tp, ep) before build_gpt_model")
    if ps.get_tensor_model_parallel_world_size() != tp or ps.get_expert_model_parallel_world_size() != ep:
        raise ValueError(f"build_gpt_model(tp={tp}, ep={ep}) but init_parallel set "
                         f"tp={ps.get_tensor_model_parallel_world_size()}, "
                         f"ep={ps.get_expert_model_parallel_world_size()}")
    s = cfg.seed if seed is None else seed
    torch.manual_seed(s)
    model_parallel_cuda_manual_seed(s)
    tcfg = transformer_config(cfg, tp=tp, ep=ep, routing_replay=routing_replay, **overrides)
    spec = layer_spec(cfg, tcfg, vp_stage)
    # cp_attention: pieces with true positions + K/V exchange (CP, split)
    # deferred: heavy (neon_hpc.models.cp_attention, neon_hpc.models.experts: megatron, wandb)
    from neon_hpc.models import cp_attention, experts as grouped
    cp_attention.hook_spec(spec)
    impl = experts or grouped.expert_impl(torch.cuda.is_available(), tcfg.params_dtype)
    if impl not in grouped.IMPLS:
        raise ValueError(f"experts={impl!r}: one of {grouped.IMPLS}")
    if impl == "grouped":
        grouped.hook_spec(spec)
    from neon_hpc.models import dispatch as moe_dispatch  # deferred: heavy (neon_hpc.models.dispatch: megatron)
    if dispatch not in moe_dispatch.IMPLS:
        raise ValueError(f"dispatch={dispatch!r}: one of {moe_dispatch.IMPLS}")
    if dispatch == "device":
        moe_dispatch.hook_spec(spec)
    with moe_dispatch.quiet_layer_build():
        model = GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                         vp_stage=vp_stage,
                         parallel_output=True, share_embeddings_and_output_weights=False,
                         position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(cfg.rope_theta))
    cp_attention.use_document_positions(model)
    return model


def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[batch, seq, vocab]`` of a causal forward (gathered over TP).

    A convenience for tests and evaluation: ``input_ids`` is ``[batch, seq]``; with sequence
    parallelism ``seq`` must be a multiple of ``tp``.
    """
    # deferred: heavy (megatron)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    b, s = input_ids.shape
    position_ids = torch.arange(s, dtype=torch.long, device=device).unsqueeze(0).expand(b, s)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
    if ps.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    return logits
