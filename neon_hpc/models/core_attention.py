"""A core attention with megatron-core's interface that takes a v head dim unlike q/k's (MLA).

megatron-core's local ``DotProductAttention`` assumes one head dim for q, k and v; only
Transformer Engine's attention (CUDA) takes MLA's ``v_head_dim != qk_head_dim``.  This module
is torch's ``scaled_dot_product_attention`` behind the same constructor and forward, so the
rest of megatron's MLA (projections, norms, RoPE/YaRN, softmax scale) is used unchanged.

Masks: megatron passes ``attention_mask`` as bool ``[b|1, 1, s, s]`` with True = *masked*
(a block-causal mask of packed documents; tests' dense reference).  ``None`` with a piece
map active (the trainer packs documents without a dense mask,
:mod:`neon_hpc.models.cp_attention`) goes to :func:`neon_hpc.models.cp_attention.piece_attention`,
with or without a K/V exchange between ranks: causal within each document by its true
positions, fused SDPA per run of contiguous positions (memory linear in length; no ``[s, s]``
mask).  ``None`` without a piece map means causal.  Dropout is not implemented (the policy
configs use 0.0; any other value is refused at construction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SDPACoreAttention(torch.nn.Module):
    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_):
        super().__init__()
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p:
            raise ValueError(f"SDPACoreAttention has no dropout; attention_dropout={p} must be 0.0")
        if getattr(config, "context_parallel_size", 1) > 1:
            # neon-hpc never sets megatron's own CP: its CP ranks are megatron DP ranks and split
            # documents exchange K/V in cp_attention.piece_attention (see forward)
            raise NotImplementedError("MLA's SDPA core attention does not run under megatron's own context "
                                      "parallelism; neon-hpc's train.context_parallel goes through "
                                      "neon_hpc.models.cp_attention instead")
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if packed_seq_params is not None:
            raise NotImplementedError("packed (THD) sequences are not supported by SDPACoreAttention")
        # megatron: [s, b, heads, dim] -> torch: [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # deferred: heavy (neon_hpc.models.cp_attention: megatron, pydantic)
        from neon_hpc.models.cp_attention import active_piece_map, piece_attention
        lay = active_piece_map()
        if attention_mask is None and lay is not None:
            # the trainer's packed documents / CP pieces: per-document fused SDPA (cp_attention)
            return piece_attention(query, key, value, lay, self.scale)
        if attention_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.to(q.device), scale=self.scale)
        return o.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
