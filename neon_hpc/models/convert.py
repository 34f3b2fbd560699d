"""HF <-> megatron-core state dicts for the Qwen3-MoE policy (full, unsharded: TP=1, EP=1).

The name table (``L`` = layer, ``E`` = expert; HF on-disk spelling on the right)::

    embedding.word_embeddings.weight                     model.embed_tokens.weight
    decoder.final_layernorm.weight                       model.norm.weight
    output_layer.weight                                  lm_head.weight
    decoder.layers.L.input_layernorm.weight              model.layers.L.input_layernorm.weight
    decoder.layers.L.pre_mlp_layernorm.weight            model.layers.L.post_attention_layernorm.weight
    decoder.layers.L.self_attention.linear_qkv.weight    q_proj, k_proj, v_proj (fused per query group)
    decoder.layers.L.self_attention.linear_proj.weight   model.layers.L.self_attn.o_proj.weight
    decoder.layers.L.self_attention.q_layernorm.weight   model.layers.L.self_attn.q_norm.weight
    decoder.layers.L.self_attention.k_layernorm.weight   model.layers.L.self_attn.k_norm.weight
    decoder.layers.L.mlp.router.weight                   model.layers.L.mlp.gate.weight
    ...mlp.experts.local_experts.E.linear_fc1.weight     [experts.E.gate_proj; experts.E.up_proj]
    ...mlp.experts.local_experts.E.linear_fc2.weight     model.layers.L.mlp.experts.E.down_proj.weight

Fused QKV layout: for each query group g, the rows of its ``heads_per_group`` query heads,
then its key head, then its value head (``head_dim`` rows each).  That makes a contiguous
split of the rows over TP ranks a split by query groups, which :func:`shard_for_rank` uses.

megatron's ``_extra_state`` entries carry no weights and are dropped/ignored.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from neon_hpc.models.config import ModelConfig
from neon_hpc.models.hf import to_disk_state_dict

_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_TOP_MAP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _take(sd: Mapping[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
    try:
        return sd[key]
    except KeyError:
        raise KeyError(f"{where} state dict lacks {key!r}; was it written for another model config?") from None


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weights (either spelling) -> full megatron GPTModel state dict (no ``_extra_state``)."""
    hf = to_disk_state_dict(hf_state_dict)
    nq, ng, hd, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
    out: dict[str, torch.Tensor] = {m: _take(hf, k, "HF").clone() for m, k in _TOP_MAP.items()}
    for L in range(cfg.num_layers):
        hp, mp = f"model.layers.{L}.", f"decoder.layers.{L}."
        for m, k in _LAYER_MAP.items():
            out[mp + m] = _take(hf, hp + k, "HF").clone()
        q = _take(hf, hp + "self_attn.q_proj.weight", "HF").reshape(ng, nq // ng * hd, h)
        k = _take(hf, hp + "self_attn.k_proj.weight", "HF").reshape(ng, hd, h)
        v = _take(hf, hp + "self_attn.v_proj.weight", "HF").reshape(ng, hd, h)
        out[mp + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h).clone()
        for e in range(cfg.num_experts):
            ep_ = f"{hp}mlp.experts.{e}."
            me = f"{mp}mlp.experts.local_experts.{e}."
            out[me + "linear_fc1.weight"] = torch.cat(
                [_take(hf, ep_ + "gate_proj.weight", "HF"), _take(hf, ep_ + "up_proj.weight", "HF")], dim=0)
            out[me + "linear_fc2.weight"] = _take(hf, ep_ + "down_proj.weight", "HF").clone()
    return out


def megatron_to_hf(megatron_state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megatron GPTModel state dict -> HF on-disk spelling (per-expert keys)."""
    md = {k: v for k, v in megatron_state_dict.items() if not k.endswith("_extra_state")}
    nq, ng, hd, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.hidden_size
    out: dict[str, torch.Tensor] = {k: _take(md, m, "megatron").clone() for m, k in _TOP_MAP.items()}
    per_group = nq // ng * hd
    for L in range(cfg.num_layers):
        hp, mp = f"model.layers.{L}.", f"decoder.layers.{L}."
        for m, k in _LAYER_MAP.items():
            out[hp + k] = _take(md, mp + m, "megatron").clone()
        qkv = _take(md, mp + "self_attention.linear_qkv.weight", "megatron").reshape(ng, per_group + 2 * hd, h)
        out[hp + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, h).clone()
        out[hp + "self_attn.k_proj.weight"] = qkv[:, per_group:per_group + hd].reshape(-1, h).clone()
        out[hp + "self_attn.v_proj.weight"] = qkv[:, per_group + hd:].reshape(-1, h).clone()
        for e in range(cfg.num_experts):
            me = f"{mp}mlp.experts.local_experts.{e}."
            gate, up = _take(md, me + "linear_fc1.weight", "megatron").chunk(2, dim=0)
            out[f"{hp}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
            out[f"{hp}mlp.experts.{e}.up_proj.weight"] = up.clone()
            out[f"{hp}mlp.experts.{e}.down_proj.weight"] = _take(md, me + "linear_fc2.weight", "megatron").clone()
    return out


# --------------------------------------------------------------------------------------
# full <-> one rank's shard (TP over rows/cols, EP over experts, expert TP = 1)

_TP_ROWS = re.compile(r"(embedding\.word_embeddings|output_layer|self_attention\.linear_qkv)\.weight$")
_TP_COLS = re.compile(r"self_attention\.linear_proj\.weight$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def shard_for_rank(full: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_rank: int = 0, tp: int = 1,
                   ep_rank: int = 0, ep: int = 1) -> dict[str, torch.Tensor]:
    """This (tp_rank, ep_rank)'s slice of a full megatron state dict, with local expert indices."""
    if cfg.num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={cfg.num_experts}")
    per_rank = cfg.num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for key, t in full.items():
        if key.endswith("_extra_state"):
            continue
        m = _EXPERT.match(key)
        if m:
            e = int(m.group(2))
            if e // per_rank == ep_rank:
                out[f"{m.group(1)}{e % per_rank}{m.group(3)}"] = t.clone()
        elif _TP_ROWS.search(key):
            out[key] = t.chunk(tp, dim=0)[tp_rank].clone()
        elif _TP_COLS.search(key):
            out[key] = t.chunk(tp, dim=1)[tp_rank].clone()
        else:
            out[key] = t.clone()
    return out


def load_into_megatron(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict`` that checks every weight by name and shape (``_extra_state`` aside)."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"megatron state dict mismatch: missing {missing[:3]} ({len(missing)}), "
                       f"unexpected {unexpected[:3]} ({len(unexpected)})")
    for k, v in own.items():
        if tuple(v.shape) != tuple(state_dict[k].shape):
            raise ValueError(f"{k}: shape {tuple(state_dict[k].shape)} does not fit the model's {tuple(v.shape)}; "
                             f"shard the full state dict with shard_for_rank(...) for this TP/EP layout")
    model.load_state_dict(dict(state_dict), strict=False)
