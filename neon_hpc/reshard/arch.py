"""Megatron-core names -> HF names, one rule table per architecture (pure, no I/O).

A *slab* is one source tensor indexed by its leading layer / expert axes (``[L, E, 2I, H]``
at ``(l, e)`` is one expert's ``[2I, H]``).  A rule turns one slab into HF tensors by an
:class:`Op` that only ever needs that slab:

* ``copy``  the whole slab
* ``rows``  rows ``[a, b)`` (SwiGLU ``[gate; up]`` halves, vocab-padding trim)
* ``qkv``   fused ``linear_qkv`` is per query group ``[q heads of the group, k, v]``;
            pick the q, k or v rows of every group

Homogeneous layers are stacked under one key with a leading layer axis
(``decoder.layers.<suffix>``); heterogeneous ones are per layer (``decoder.layers.N.<suffix>``).
Experts add an expert axis after the layer axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Callable

from neon_hpc.reshard.metadata import Checkpoint, CheckpointError, TensorMeta

ARCHES = ("qwen3_moe", "deepseek_v3")
# HF model_type -> our rule table.  Kimi-K2 ships model_type "kimi_k2" with DeepSeek-V3 weights.
MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3"}
# Checkpoint keys outside these prefixes are not model weights (optimizer state, rng, ...).
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")


class MappingError(CheckpointError):
    """A checkpoint key or shape does not fit the architecture's rules."""


@dataclass(frozen=True)
class Op:
    kind: str                      # "copy" | "rows" | "qkv"
    args: tuple = ()


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    op: Op

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Slab:
    key: str
    index: tuple[int, ...]         # leading indices into the global tensor
    shape: tuple[int, ...]         # global shape with the leading axes removed
    dtype: str
    outputs: tuple[OutTensor, ...]


@dataclass(frozen=True)
class ModelSpec:
    """The few HF config fields the tensor mapping needs."""

    arch: str
    vocab_size: int | None          # None: keep the checkpoint's (padded) rows
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None

    @classmethod
    def from_hf_config(cls, cfg: dict, arch: str | None = None) -> "ModelSpec":
        model_type = cfg.get("model_type")
        resolved = arch or MODEL_TYPES.get(model_type or "")
        if resolved not in ARCHES:
            raise MappingError(f"unknown architecture {arch or model_type!r} (config model_type={model_type!r}); "
                               f"supported: {', '.join(ARCHES)} (and kimi_k2 as deepseek_v3)")
        heads = cfg.get("num_attention_heads")
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
        return cls(resolved, cfg.get("vocab_size"), heads, cfg.get("num_key_value_heads", heads), head_dim)


# ---------------------------------------------------------------------------------------
# ops (pure shape logic here; the executor applies them to tensors)


def op_shape(op: Op, slab_shape: tuple[int, ...]) -> tuple[int, ...]:
    if op.kind == "copy":
        return slab_shape
    if op.kind == "rows":
        a, b = op.args
        return (b - a, *slab_shape[1:])
    if op.kind == "qkv":
        part, groups, q_per_group, head_dim = op.args
        heads = groups * (q_per_group if part == "q" else 1)
        return (heads * head_dim, *slab_shape[1:])
    raise ValueError(op.kind)


def apply_op(op: Op, slab):
    """Apply ``op`` to a torch tensor slab; returns a contiguous tensor."""
    if op.kind == "copy":
        return slab.contiguous()
    if op.kind == "rows":
        a, b = op.args
        return slab[a:b].contiguous()
    if op.kind == "qkv":
        part, groups, q_per_group, head_dim = op.args
        per_group = slab.reshape(groups, q_per_group + 2, head_dim, *slab.shape[1:])
        sel = {"q": slice(0, q_per_group), "k": slice(q_per_group, q_per_group + 1),
               "v": slice(q_per_group + 1, q_per_group + 2)}[part]
        out = per_group[:, sel]
        return out.reshape(-1, *slab.shape[1:]).contiguous()
    raise ValueError(op.kind)


# ---------------------------------------------------------------------------------------
# rules: (spec, slab shape) -> [(hf suffix, op)]

Rule = Callable[[ModelSpec, tuple[int, ...], str], list[tuple[str, Op]]]


def _copy(name: str) -> Rule:
    return lambda spec, shape, key: [(name, Op("copy"))]


def _swiglu(prefix: str) -> Rule:
    def rule(spec, shape, key):
        if shape[0] % 2:
            raise MappingError(f"{key}: SwiGLU linear_fc1 has an odd row count {shape[0]}; expected [gate; up]")
        half = shape[0] // 2
        return [(f"{prefix}gate_proj.weight", Op("rows", (0, half))),
                (f"{prefix}up_proj.weight", Op("rows", (half, shape[0])))]
    return rule


def _qkv(suffix: str) -> Rule:
    def rule(spec, shape, key):
        if not (spec.num_attention_heads and spec.num_key_value_heads and spec.head_dim):
            raise MappingError(f"{key}: splitting fused QKV needs num_attention_heads, num_key_value_heads "
                               f"and head_dim; pass --hf-config-dir with a config.json")
        g, d = spec.num_key_value_heads, spec.head_dim
        qpg = spec.num_attention_heads // g
        if shape[0] != g * (qpg + 2) * d:
            raise MappingError(f"{key}: {shape[0]} rows, but {g} query groups x ({qpg} q + k + v) x head_dim {d} "
                               f"= {g * (qpg + 2) * d}; the HF config does not match this checkpoint")
        return [(f"self_attn.{p}_proj.{suffix}", Op("qkv", (p, g, qpg, d))) for p in "qkv"]
    return rule


def _vocab(name: str) -> Rule:
    def rule(spec, shape, key):
        vocab = spec.vocab_size or shape[0]
        if vocab > shape[0]:
            raise MappingError(f"{key}: {shape[0]} rows but the HF config says vocab_size={vocab}")
        return [(name, Op("rows", (0, vocab)) if vocab < shape[0] else Op("copy"))]
    return rule


_COMMON_LAYER: dict[str, Rule] = {
    "self_attention.linear_qkv.layer_norm_weight": _copy("input_layernorm.weight"),
    "input_layernorm.weight": _copy("input_layernorm.weight"),
    "self_attention.linear_proj.weight": _copy("self_attn.o_proj.weight"),
    "mlp.linear_fc1.layer_norm_weight": _copy("post_attention_layernorm.weight"),
    "pre_mlp_layernorm.weight": _copy("post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": _swiglu("mlp."),
    "mlp.linear_fc2.weight": _copy("mlp.down_proj.weight"),
    "mlp.router.weight": _copy("mlp.gate.weight"),
}
_QWEN3_LAYER: dict[str, Rule] = {
    **_COMMON_LAYER,
    "self_attention.linear_qkv.weight": _qkv("weight"),
    "self_attention.linear_qkv.bias": _qkv("bias"),
    "self_attention.q_layernorm.weight": _copy("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _copy("self_attn.k_norm.weight"),
}
_DSV3_LAYER: dict[str, Rule] = {
    **_COMMON_LAYER,
    "mlp.router.expert_bias": _copy("mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": _swiglu("mlp.shared_experts."),
    "mlp.shared_experts.linear_fc2.weight": _copy("mlp.shared_experts.down_proj.weight"),
    "self_attention.linear_q_proj.weight": _copy("self_attn.q_proj.weight"),
    "self_attention.linear_q_down_proj.weight": _copy("self_attn.q_a_proj.weight"),
    "self_attention.linear_q_up_proj.weight": _copy("self_attn.q_b_proj.weight"),
    "self_attention.linear_q_up_proj.layer_norm_weight": _copy("self_attn.q_a_layernorm.weight"),
    "self_attention.q_layernorm.weight": _copy("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_kv_down_proj.weight": _copy("self_attn.kv_a_proj_with_mqa.weight"),
    "self_attention.linear_kv_up_proj.weight": _copy("self_attn.kv_b_proj.weight"),
    "self_attention.linear_kv_up_proj.layer_norm_weight": _copy("self_attn.kv_a_layernorm.weight"),
    "self_attention.kv_layernorm.weight": _copy("self_attn.kv_a_layernorm.weight"),
}
_EXPERT: dict[str, Rule] = {
    "mlp.experts.experts.linear_fc1.weight": _swiglu(""),
    "mlp.experts.experts.linear_fc2.weight": _copy("down_proj.weight"),
}
_TOP: dict[str, Rule] = {
    "embedding.word_embeddings.weight": _vocab("model.embed_tokens.weight"),
    "output_layer.weight": _vocab("lm_head.weight"),
    "decoder.final_layernorm.weight": _copy("model.norm.weight"),
}
LAYER_RULES = {"qwen3_moe": _QWEN3_LAYER, "deepseek_v3": _DSV3_LAYER}
# Keys that are model state but carry no HF tensor (TE extra state, routing statistics).
_IGNORED_SUFFIXES = ("._extra_state", "local_tokens_per_expert")

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(.+)$")


def is_model_key(key: str) -> bool:
    return key.startswith(MODEL_PREFIXES) and not key.endswith(_IGNORED_SUFFIXES)


def _layer_slabs(spec: ModelSpec, tm: TensorMeta, suffix: str, lead: tuple[int, ...],
                 layer_of: Callable[[tuple[int, ...]], int]) -> list[Slab]:
    """Slabs of a decoder-layer key; ``lead`` = leading axes already fixed by the key name."""
    is_expert = suffix in _EXPERT
    rules = _EXPERT if is_expert else LAYER_RULES[spec.arch]
    rule = rules.get(suffix)
    if rule is None:
        raise MappingError(f"checkpoint key {tm.key!r}: no {spec.arch} rule for '{suffix}'. Either the "
                           f"checkpoint is not a {spec.arch} model (pass --arch) or this layer type is unsupported.")
    n_axes = (0 if lead else 1) + (1 if is_expert else 0)
    if len(tm.shape) < n_axes + 1:
        raise MappingError(f"{tm.key}: shape {list(tm.shape)} lacks the expected "
                           f"{'layer/' if not lead else ''}{'expert ' if is_expert else ''}axes")
    slabs = []
    for idx in _indices(tm.shape[:n_axes]):
        full = lead + idx
        layer = layer_of(full)
        slab_shape = tm.shape[n_axes:]
        base = f"model.layers.{layer}." + (f"mlp.experts.{full[-1]}." if is_expert else "")
        outs = tuple(OutTensor(base + name, op_shape(op, slab_shape), tm.dtype, op)
                     for name, op in rule(spec, slab_shape, tm.key))
        slabs.append(Slab(tm.key, idx, slab_shape, tm.dtype, outs))
    return slabs


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = [()]
    for n in shape:
        out = [i + (j,) for i in out for j in range(n)]
    return out


def slabs_for_key(spec: ModelSpec, tm: TensorMeta) -> list[Slab]:
    """All slabs (with their HF outputs) of one checkpoint key."""
    key = tm.key
    if key in _TOP:
        outs = tuple(OutTensor(n, op_shape(op, tm.shape), tm.dtype, op) for n, op in _TOP[key](spec, tm.shape, key))
        return [Slab(key, (), tm.shape, tm.dtype, outs)]
    if (m := _PER_LAYER.match(key)):
        layer = int(m.group(1))
        return _layer_slabs(spec, tm, m.group(2), (layer,), lambda full: full[0])
    if (m := _STACKED.match(key)):
        # Stacked: axis 0 is the (global) layer number.
        slabs = _layer_slabs(spec, tm, m.group(1), (), lambda full: full[0])
        return slabs
    raise MappingError(f"checkpoint key {key!r} has no {spec.arch} rule (multi-token-prediction layers and "
                       f"other extra modules are not converted)")


def plan_slabs(ckpt: Checkpoint, spec: ModelSpec) -> list[Slab]:
    """Every slab of every model key, checked for duplicate HF names."""
    slabs: list[Slab] = []
    for key in sorted(ckpt.tensors):
        if is_model_key(key):
            slabs.extend(slabs_for_key(spec, ckpt.tensors[key]))
    seen: dict[str, str] = {}
    for s in slabs:
        for o in s.outputs:
            if o.name in seen:
                raise MappingError(f"HF tensor {o.name} comes from both {seen[o.name]} and {s.key}; "
                                   f"the checkpoint mixes stacked and per-layer keys for the same weight")
            seen[o.name] = s.key
    if not slabs:
        raise MappingError(f"{ckpt.path}: no model weights found (keys start with {', '.join(MODEL_PREFIXES)})")
    return slabs
