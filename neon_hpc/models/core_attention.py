"""A core attention with megatron-core's interface that takes a v head dim unlike q/k's (MLA).

megatron-core's local ``DotProductAttention`` assumes one head dim for q, k and v; only
Transformer Engine's attention (CUDA) takes MLA's ``v_head_dim != qk_head_dim``.  This module
is torch's ``scaled_dot_product_attention`` behind the same constructor and forward, so the
rest of megatron's MLA (projections, norms, RoPE/YaRN, softmax scale) is used unchanged.

Masks: megatron passes ``attention_mask`` as bool ``[b|1, 1, s, s]`` with True = *masked*
(the trainer's block-causal mask of packed documents); ``None`` means causal.  Dropout is not
implemented (the policy configs use 0.0; any other value is refused at construction).
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
            raise NotImplementedError("MLA's SDPA core attention does not run under context parallelism "
                                      "(train.context_parallel must be 1 for deepseek_v3)")
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if packed_seq_params is not None:
            raise NotImplementedError("packed (THD) sequences are not supported by SDPACoreAttention")
        # megatron: [s, b, heads, dim] -> torch: [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.to(q.device), scale=self.scale)
        return o.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
