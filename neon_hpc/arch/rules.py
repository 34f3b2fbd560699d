"""The megatron <-> HF mapping's vocabulary: a name :class:`NameRule`, the tables every architecture
shares, the pure tensor helpers (fused QKV per query group, tensor-parallel slices), and
:func:`hf_getter` (one way to read an HF config, a dict or a transformers object).  Each
architecture's own table is ``hfmap.py`` in its folder.

**A rule** turns one megatron weight (at a fixed layer, and expert for expert weights) into
HF weights:

* ``copy``    one HF tensor, the same values
* ``swiglu``  ``linear_fc1`` ``[gate; up]`` -> ``(gate_proj, up_proj)``, halves of the rows
* ``qkv``     fused ``linear_qkv``, per query group ``[q heads, k, v]`` -> ``(q, k, v)``
* ``vocab``   embeddings / output layer: HF keeps the first ``vocab_size`` rows (padding dropped)

``tp`` says how megatron splits the weight over tensor-parallel ranks (``rows``, ``cols``,
``swiglu``: each rank holds ``[its gate rows; its up rows]``; ``None``: replicated).  Rules
marked ``alias`` are other spellings of a weight (Transformer Engine's fused norms) that a
checkpoint may carry: read (megatron -> HF) only, never produced.

Tensor helpers work on anything with torch's tensor methods; only ``tp_shard``/``tp_join``
import torch, when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class NameRule:
    hf: tuple[str, ...]                # HF names, relative to the layer ("self_attn.o_proj.weight") or absolute (top)
    split: str = "copy"                # copy | swiglu | qkv | vocab
    tp: str | None = None              # None | rows | cols | swiglu
    alias: bool = False                # read-only spelling (TE fused norms)


@dataclass(frozen=True)
class QKVShape:
    groups: int
    q_per_group: int
    head_dim: int


# ---------------------------------------------------------------------------------------
# tensor helpers (pure: only tensor methods; callers pass torch or numpy arrays)

def qkv_part(t, part: str, s: QKVShape):
    """The ``q``, ``k`` or ``v`` rows of a fused per-group ``[q heads, k, v]`` tensor."""
    per = t.reshape(s.groups, s.q_per_group + 2, s.head_dim, *t.shape[1:])
    sel = {"q": slice(0, s.q_per_group), "k": slice(s.q_per_group, s.q_per_group + 1),
           "v": slice(s.q_per_group + 1, s.q_per_group + 2)}[part]
    return per[:, sel].reshape(-1, *t.shape[1:])


def qkv_rows(part: str, s: QKVShape) -> int:
    return s.groups * (s.q_per_group if part == "q" else 1) * s.head_dim


def qkv_join(q, k, v, s: QKVShape, cat: Callable):
    """Inverse of :func:`qkv_part`; ``cat(list, dim)`` is ``torch.cat`` (or ``np.concatenate``)."""
    rest = tuple(q.shape[1:])
    parts = [q.reshape(s.groups, s.q_per_group * s.head_dim, *rest),
             k.reshape(s.groups, s.head_dim, *rest), v.reshape(s.groups, s.head_dim, *rest)]
    return cat(parts, 1).reshape(-1, *rest)


def tp_shard(t, kind: str | None, rank: int, tp: int):
    """This TP rank's slice of a full megatron weight split ``kind`` (see :class:`NameRule`)."""
    if kind is None or tp == 1:
        return t
    if kind == "rows":
        return t.chunk(tp, dim=0)[rank]
    if kind == "cols":
        return t.chunk(tp, dim=1)[rank]
    if kind == "swiglu":
        import torch  # deferred: heavy (torch)
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    raise ValueError(f"unknown TP split {kind!r}")


def tp_join(parts: Sequence, kind: str | None):
    """Inverse of :func:`tp_shard` over all TP ranks' slices (in rank order)."""
    import torch  # deferred: heavy (torch)
    if kind is None or len(parts) == 1:
        return parts[0]
    if kind == "rows":
        return torch.cat(list(parts), dim=0)
    if kind == "cols":
        return torch.cat(list(parts), dim=1)
    if kind == "swiglu":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(f"unknown TP split {kind!r}")


# ---------------------------------------------------------------------------------------
# tables every architecture shares

TOP_RULES: dict[str, NameRule] = {
    "embedding.word_embeddings.weight": NameRule(("model.embed_tokens.weight",), "vocab", "rows"),
    "output_layer.weight": NameRule(("lm_head.weight",), "vocab", "rows"),
    "decoder.final_layernorm.weight": NameRule(("model.norm.weight",)),
}
# Expert weights: megatron ``...mlp.experts.local_experts.E.<suffix>`` (in memory) or
# ``...mlp.experts.experts.<suffix>`` with an expert axis (torch_dist); HF ``mlp.experts.E.<name>``.
EXPERT_RULES: dict[str, NameRule] = {
    "linear_fc1.weight": NameRule(("gate_proj.weight", "up_proj.weight"), "swiglu"),
    "linear_fc2.weight": NameRule(("down_proj.weight",)),
}
# Norms and MLP weights every architecture here shares (local-spec names, then TE aliases).
COMMON_LAYER_RULES: dict[str, NameRule] = {
    "input_layernorm.weight": NameRule(("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": NameRule(("post_attention_layernorm.weight",)),
    "self_attention.linear_proj.weight": NameRule(("self_attn.o_proj.weight",), tp="cols"),
    "mlp.router.weight": NameRule(("mlp.gate.weight",)),
    "mlp.linear_fc1.weight": NameRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "swiglu", "swiglu"),
    "mlp.linear_fc2.weight": NameRule(("mlp.down_proj.weight",), tp="cols"),
    "self_attention.linear_qkv.layer_norm_weight": NameRule(("input_layernorm.weight",), alias=True),
    "mlp.linear_fc1.layer_norm_weight": NameRule(("post_attention_layernorm.weight",), alias=True),
}


# megatron state-dict entries that carry no HF tensor (TE extra state, routing statistics)
IGNORED_SUFFIXES = ("_extra_state", "local_tokens_per_expert")


def hf_getter(hf_cfg: Any) -> Callable:
    """``g(name, default=None)`` for an HF config dict or a transformers config object."""
    if isinstance(hf_cfg, dict):
        return hf_cfg.get
    return lambda k, d=None: getattr(hf_cfg, k, d)
