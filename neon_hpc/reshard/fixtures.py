"""Test fixtures: real megatron-core checkpoints of the tiny Qwen3-MoE at several layouts.

``save_layouts(out_dir, layouts)`` starts two gloo processes once, and for each ``(tp, ep)``
builds the megatron-core GPTModel (``neon_hpc.models``), moves every weight away from its
initial value (norms away from 1, so swapped norms would show in the logits), computes the
logits of fixed token ids, and saves the model's sharded state dict with
``dist_checkpointing.save`` (torch_dist).  Written per layout ``L = tp{tp}_ep{ep}``:
``L/ckpt/`` (the checkpoint), ``L/logits.npy``, and once ``hf_config/config.json`` and
``ids.npy``.  megatron-core is imported here only in the spawned processes; the converter
never imports this module.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np


def layout_name(tp: int, ep: int) -> str:
    return f"tp{tp}_ep{ep}"


def _perturb(model, tp_rank: int, ep_rank: int) -> None:
    """Add seeded noise; replicated params get the same noise on every rank (seed = name)."""
    import torch
    for name, p in model.named_parameters():
        seed = zlib.crc32(name.encode())
        if ".experts." in name:   # expert weight: distinct per EP rank (expert TP = 1; replicated over expert-DP)
            seed += ep_rank * 104729
        elif getattr(p, "tensor_model_parallel", False):  # TP shard: distinct per TP rank
            seed += tp_rank * 7919
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _start(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)


def _worker(rank: int, world: int, port: int, out: str, layouts: list, seq: int) -> None:
    _start(rank, world, port)
    _layouts_in_group(out, layouts, seq)
    from neon_hpc.models import megatron
    megatron.destroy_parallel()


def _layouts_in_group(out: str, layouts: list, seq: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from neon_hpc.models import hf, megatron
    from neon_hpc.models.config import ModelConfig

    cfg = ModelConfig()
    rank = dist.get_rank()
    out_p = Path(out)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, seq))
    if rank == 0:
        hf.hf_config(cfg).save_pretrained(out_p / "hf_config")
        np.save(out_p / "ids.npy", ids)
    for tp, ep in layouts:
        coords = megatron.init_parallel(tp=tp, ep=ep)
        model = megatron.build_gpt_model(cfg, tp=tp, ep=ep)
        _perturb(model, coords["tp_rank"], coords["ep_rank"])
        model.eval()
        with torch.no_grad():
            logits = megatron.forward_logits(model, torch.from_numpy(ids))
        d = out_p / layout_name(tp, ep)
        if rank == 0:
            (d / "ckpt").mkdir(parents=True)
            np.save(d / "logits.npy", logits.float().numpy())
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(d / "ckpt"))
        dist.barrier()


def save_layouts(out_dir: str | os.PathLike, layouts=((1, 1), (2, 1), (1, 2), (2, 2)), seq: int = 8) -> Path:
    """Save one checkpoint per (tp, ep) layout from two gloo processes; returns ``out_dir``."""
    import torch.multiprocessing as mp
    from neon_hpc.netutil import free_port
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(2, free_port(), str(out), [tuple(x) for x in layouts], seq),
                       nprocs=2, join=True, start_method="spawn")
    return out


# ---------------------------------------------------------------------------------------
# DeepSeek-V3-style MLA model: dense first layer, shared experts, sigmoid router with bias

MLA_HF_CONFIG = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=256, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
    rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleave=True, tie_word_embeddings=False,
    max_position_embeddings=256, attention_bias=False)


def _mla_core_attention():
    """Causal SDPA with megatron's core-attention interface.

    megatron-core's local ``DotProductAttention`` cannot take MLA's separate k/v head dims
    (only Transformer Engine's can, which needs CUDA), so the MLA fixture uses this plain
    stand-in; everything else (projections, norms, RoPE, router, experts) is megatron's.
    """
    import torch
    import torch.nn.functional as F

    class CausalSDPA(torch.nn.Module):
        def __init__(self, config, layer_number, attn_mask_type, attention_type=None, softmax_scale=None, **_):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))      # [b, h, s, d]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return o.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return CausalSDPA


def _mla_config():
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    c = MLA_HF_CONFIG
    return MLATransformerConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["intermediate_size"], q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
        qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
        rope_type="rope", rotary_base=c["rope_theta"], normalization="RMSNorm", layernorm_epsilon=c["rms_norm_eps"],
        qk_layernorm=True, num_moe_experts=c["n_routed_experts"], moe_layer_freq=[0, 1],
        moe_ffn_hidden_size=c["moe_intermediate_size"], moe_router_topk=c["num_experts_per_tok"],
        moe_shared_expert_intermediate_size=c["moe_intermediate_size"] * c["n_shared_experts"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_permute_fusion=False, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, params_dtype=torch.float32, use_cpu_initialization=True)


def _mla_worker(rank: int, out: str, seq: int) -> None:
    from neon_hpc.models import megatron
    from neon_hpc.netutil import free_port
    _start(rank, 1, free_port())
    _mla_in_group(out, seq)
    megatron.destroy_parallel()


def _mla_in_group(out: str, seq: int) -> None:
    """Build, run and save the MLA model on every rank of the group (TP=1: ranks are DP replicas)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from neon_hpc.models import megatron
    megatron.init_parallel(tp=1, ep=1)
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    if not isinstance(mla.TELinear, type):   # without TE it is a placeholder; isinstance() would raise
        mla.TELinear = type("NoTELinear", (), {})
    cfg = _mla_config()
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _mla_core_attention()
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=MLA_HF_CONFIG["vocab_size"],
                     max_sequence_length=256, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, rotary_base=int(MLA_HF_CONFIG["rope_theta"]))
    _perturb(model, 0, 0)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):   # a non-zero bias, so a dropped or misnamed bias shows in routing
            buf.copy_(0.5 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(7)))
    model.eval()
    ids = np.random.default_rng(0).integers(0, MLA_HF_CONFIG["vocab_size"], size=(2, seq))
    with torch.no_grad():
        logits = megatron.forward_logits(model, torch.from_numpy(ids))
    out_p = Path(out)
    if dist.get_rank() == 0:
        (out_p / "ckpt").mkdir(parents=True)
        np.save(out_p / "ids.npy", ids)
        np.save(out_p / "logits.npy", logits.float().numpy())
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out_p / "ckpt"))
    dist.barrier()


def save_mla(out_dir: str | os.PathLike, seq: int = 8) -> Path:
    """Save the MLA model's checkpoint, logits and HF ``config.json`` (``hf_config/``) under ``out_dir``."""
    import torch.multiprocessing as mp
    out = Path(out_dir)
    _write_mla_config(out)
    mp.start_processes(_mla_worker, args=(str(out), seq), nprocs=1, join=True, start_method="spawn")
    return out


def _write_mla_config(out: Path) -> None:
    import json
    (out / "hf_config").mkdir(parents=True, exist_ok=True)
    (out / "hf_config" / "config.json").write_text(json.dumps(MLA_HF_CONFIG, indent=1))


# ---------------------------------------------------------------------------------------
# everything at once: one pair of processes (megatron-core imports once per process)

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))


def _all_worker(rank: int, world: int, port: int, out: str, synth: dict, seq: int) -> None:
    _start(rank, world, port)
    import torch.distributed as dist
    from neon_hpc.models import megatron
    from neon_hpc.reshard.synthetic import SynthSpec, save_in_group
    megatron.init_parallel(tp=1, ep=1)              # the gloo group every part below shares
    save_in_group(Path(out) / "synth" / "ckpt", SynthSpec(**synth))
    _layouts_in_group(str(Path(out) / "layouts"), list(LAYOUTS), seq)
    _mla_in_group(str(Path(out) / "mla"), seq)
    dist.barrier()
    megatron.destroy_parallel()


def build_all(out_dir: str | os.PathLike, synth, seq: int = 8) -> Path:
    """The synthetic checkpoint (``synth/``), the Qwen3-MoE layouts (``layouts/``) and the MLA
    model (``mla/``), saved by one pair of gloo processes.  Cached: a second call returns at once."""
    import json
    from dataclasses import asdict
    import torch.multiprocessing as mp
    from neon_hpc.netutil import free_port
    out = Path(out_dir)
    if (out / "DONE").exists():
        return out
    if synth.procs != 2:
        raise ValueError("build_all saves from 2 processes; use a SynthSpec with procs=2")
    (out / "synth" / "ckpt").mkdir(parents=True)
    (out / "synth" / "hf").mkdir()
    (out / "synth" / "hf" / "config.json").write_text(json.dumps(synth.hf_config()))
    (out / "synth" / "hf" / "tokenizer.json").write_text("{}")
    _write_mla_config(out / "mla")
    mp.start_processes(_all_worker, args=(2, free_port(), str(out), asdict(synth), seq), nprocs=2,
                       join=True, start_method="spawn")
    (out / "DONE").write_text("ok\n")
    return out


def small_synth_spec():
    """The small synthetic checkpoint the tests use (bf16, TP=2 fragments, vocab 250 padded to 256)."""
    from neon_hpc.reshard.synthetic import SynthSpec
    return SynthSpec(layers=2, experts=4, hidden=32, moe_ffn=16, heads=4, groups=2, head_dim=8, vocab=250,
                     tp=2, procs=2, optimizer_states=1)


def shared(tmp_path_factory) -> Path:
    """pytest helper: every reshard test module shares one :func:`build_all` per session."""
    return build_all(tmp_path_factory.getbasetemp() / "reshard_fixtures", small_synth_spec())
