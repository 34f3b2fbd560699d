"""Megatron-core checkpoint keys -> HF tensors: the architecture's name rules
(:mod:`neon_hpc.arch`: its folder's ``hfmap.py`` and :mod:`neon_hpc.arch.rules`, the same objects
the trainer's exporter uses) applied to torch_dist keys and shapes (pure, no I/O).

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

from neon_hpc import arch as registry
from neon_hpc.arch.rules import EXPERT_RULES, IGNORED_SUFFIXES, TOP_RULES, NameRule, QKVShape, qkv_part, qkv_rows
from neon_hpc.checkpoint.metadata import Checkpoint, CheckpointError, TensorMeta

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


def canonical_arch(arch: str | None, model_type: str | None = None) -> str:
    """The architecture of ``arch`` (``--arch``, a config ``model.arch``) or else of an HF
    ``model_type``, as a mapping name (an alias -> its architecture, :mod:`neon_hpc.arch`); MappingError
    naming both."""
    resolved = registry.MODEL_TYPES.get(arch or model_type or "")
    if resolved not in registry.ARCHES:
        raise MappingError(f"unknown architecture {arch or model_type!r} (config model_type={model_type!r}); "
                           f"supported: {registry.known()}")
    return resolved


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
        resolved = canonical_arch(arch, cfg.get("model_type"))
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
        return (qkv_rows(part, QKVShape(groups, q_per_group, head_dim)), *slab_shape[1:])
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
        return qkv_part(slab, part, QKVShape(groups, q_per_group, head_dim)).contiguous()
    raise ValueError(op.kind)


# ---------------------------------------------------------------------------------------
# an architecture's name rule at a slab's shape -> [(hf suffix, op)]

Rule = Callable[[ModelSpec, tuple[int, ...], str], list[tuple[str, Op]]]


def _ops(rule: NameRule, spec: ModelSpec, shape: tuple[int, ...], key: str) -> list[tuple[str, Op]]:
    if rule.split == "copy":
        return [(rule.hf[0], Op("copy"))]
    if rule.split == "swiglu":
        if shape[0] % 2:
            raise MappingError(f"{key}: SwiGLU linear_fc1 has an odd row count {shape[0]}; expected [gate; up]")
        half = shape[0] // 2
        return [(rule.hf[0], Op("rows", (0, half))), (rule.hf[1], Op("rows", (half, shape[0])))]
    if rule.split == "vocab":
        vocab = spec.vocab_size or shape[0]
        if vocab > shape[0]:
            raise MappingError(f"{key}: {shape[0]} rows but the HF config says vocab_size={vocab}")
        return [(rule.hf[0], Op("rows", (0, vocab)) if vocab < shape[0] else Op("copy"))]
    if rule.split == "qkv":
        if not (spec.num_attention_heads and spec.num_key_value_heads and spec.head_dim):
            raise MappingError(f"{key}: splitting fused QKV needs num_attention_heads, num_key_value_heads "
                               f"and head_dim; pass --hf-config-dir with a config.json")
        g, d = spec.num_key_value_heads, spec.head_dim
        qpg = spec.num_attention_heads // g
        if shape[0] != g * (qpg + 2) * d:
            raise MappingError(f"{key}: {shape[0]} rows, but {g} query groups x ({qpg} q + k + v) x head_dim {d} "
                               f"= {g * (qpg + 2) * d}; the HF config does not match this checkpoint")
        return [(name, Op("qkv", (p, g, qpg, d))) for name, p in zip(rule.hf, "qkv")]
    raise MappingError(f"{key}: unknown split {rule.split!r}")


def _rule(table: dict[str, NameRule], suffix: str) -> Rule | None:
    r = table.get(suffix)
    return None if r is None else (lambda spec, shape, key: _ops(r, spec, shape, key))


_EXPERT_PREFIX = "mlp.experts.experts."          # torch_dist: experts stacked on an expert axis
_EXPERT = {_EXPERT_PREFIX + k: v for k, v in EXPERT_RULES.items()}
_TOP = TOP_RULES
# Keys that are model state but carry no HF tensor (TE extra state, routing statistics).
_IGNORED_SUFFIXES = tuple("." + s if s.startswith("_") else s for s in IGNORED_SUFFIXES)

_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(.+)$")


def is_model_key(key: str) -> bool:
    return key.startswith(MODEL_PREFIXES) and not key.endswith(_IGNORED_SUFFIXES)


def _layer_slabs(spec: ModelSpec, tm: TensorMeta, suffix: str, lead: tuple[int, ...],
                 layer_of: Callable[[tuple[int, ...]], int]) -> list[Slab]:
    """Slabs of a decoder-layer key; ``lead`` = leading axes already fixed by the key name."""
    is_expert = suffix in _EXPERT
    rule = _rule(_EXPERT if is_expert else registry.get(spec.arch).layer_rules, suffix)
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
        outs = tuple(OutTensor(n, op_shape(op, tm.shape), tm.dtype, op)
                     for n, op in _ops(_TOP[key], spec, tm.shape, key))
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


def list_slabs(ckpt: Checkpoint, spec: ModelSpec) -> list[Slab]:
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
