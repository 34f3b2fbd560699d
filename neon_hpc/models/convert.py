"""HF <-> megatron-core state dicts (full, unsharded: TP=1, EP=1), and one rank's slice.

The name and slicing rules are the architecture's (:mod:`neon_hpc.arch`: its folder's
``hfmap.py`` and :mod:`neon_hpc.arch.rules`, the same tables the reshard tool reads); this module
only applies them to in-memory tensors:

- megatron per-layer keys ``decoder.layers.L.<suffix>`` (the architecture's ``layer_rules``), local experts
  ``decoder.layers.L.mlp.experts.local_experts.E.<suffix>`` (``EXPERT_RULES``), top-level keys
  (``TOP_RULES``);
- HF on-disk spelling (per-expert keys); either HF spelling is accepted as input.

megatron's ``_extra_state`` and routing-statistics buffers carry no weights and are dropped.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from neon_hpc import arch
from neon_hpc.arch.rules import EXPERT_RULES, IGNORED_SUFFIXES, NameRule, qkv_join, qkv_part, tp_shard
from neon_hpc.config.model import ModelConfig
from neon_hpc.models.hf import to_disk_state_dict

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _take(sd: Mapping[str, torch.Tensor], key: str, where: str) -> torch.Tensor:
    try:
        return sd[key]
    except KeyError:
        raise KeyError(f"{where} state dict lacks {key!r}; was it written for another model config?") from None


def _split(rule: NameRule, t: torch.Tensor, cfg: ModelConfig, key: str) -> list[torch.Tensor]:
    if rule.split == "copy":
        return [t]
    if rule.split == "vocab":
        return [t[:cfg.vocab_size]]
    if rule.split == "swiglu":
        return list(t.chunk(2, dim=0))
    if rule.split == "qkv":
        s = arch.get(cfg.arch).qkv_shape(cfg)
        return [qkv_part(t, p, s) for p in "qkv"]
    raise ValueError(f"{key}: unknown split {rule.split!r}")


def _join(rule: NameRule, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if rule.split in ("copy", "vocab"):
        return parts[0]
    if rule.split == "swiglu":
        return torch.cat(parts, dim=0)
    if rule.split == "qkv":
        return qkv_join(*parts, arch.get(cfg.arch).qkv_shape(cfg), torch.cat)
    raise ValueError(f"unknown split {rule.split!r}")


def megatron_to_hf(megatron_state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megatron GPTModel state dict -> HF on-disk spelling (per-expert keys)."""
    a = arch.get(cfg.arch)
    out: dict[str, torch.Tensor] = {}
    for key, t in megatron_state_dict.items():
        if key.endswith(IGNORED_SUFFIXES):
            continue
        if key in a.top_rules:
            rule, base = a.top_rules[key], ""
        elif (m := _LAYER.match(key)):
            layer, suffix = int(m.group(1)), m.group(2)
            base = f"model.layers.{layer}."
            if (e := _LOCAL_EXPERT.match(suffix)):
                rule, base = EXPERT_RULES.get(e.group(2)), f"{base}mlp.experts.{e.group(1)}."
            else:
                rule = a.layer_rules.get(suffix)
        else:
            rule = None
        if rule is None:
            raise KeyError(f"megatron key {key!r} has no {a.name} rule (neon_hpc/arch/{a.name}/hfmap.py); "
                           f"is model.arch right for this model?")
        for name, part in zip(rule.hf, _split(rule, t, cfg, key)):
            out[base + name] = part.clone()
    return out


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weights (either spelling) -> full megatron GPTModel state dict (no ``_extra_state``).

    Every HF tensor must be used: one the architecture has no megatron home for is an error."""
    a = arch.get(cfg.arch)
    hf = to_disk_state_dict(hf_state_dict)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return _take(hf, name, "HF")

    out: dict[str, torch.Tensor] = {}
    for key, rule in a.top_rules.items():
        out[key] = _join(rule, [take(n) for n in rule.hf], cfg).clone()
    moe = set(a.moe_layers(cfg))
    for L in range(cfg.num_layers):
        hp, mp = f"model.layers.{L}.", f"decoder.layers.{L}."
        for suffix in a.layer_suffixes(cfg, L):
            rule = a.layer_rules[suffix]
            out[mp + suffix] = _join(rule, [take(hp + n) for n in rule.hf], cfg).clone()
        if L in moe:
            for e in range(cfg.num_experts):
                for suffix, rule in EXPERT_RULES.items():
                    out[f"{mp}mlp.experts.local_experts.{e}.{suffix}"] = _join(
                        rule, [take(f"{hp}mlp.experts.{e}.{n}") for n in rule.hf], cfg).clone()
    unused = sorted(set(hf) - used)
    if unused:
        raise KeyError(f"HF state dict has {len(unused)} tensor(s) the {a.name} model does not have, e.g. "
                       f"{unused[:3]}; does model: (num_layers, first_dense_layers, num_shared_experts, "
                       f"q_lora_rank) match the checkpoint?")
    return out


# --------------------------------------------------------------------------------------
# full <-> one rank's shard (TP over rows/cols, EP over experts, expert TP = 1)

def shard_for_rank(full: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_rank: int = 0, tp: int = 1,
                   ep_rank: int = 0, ep: int = 1) -> dict[str, torch.Tensor]:
    """This (tp_rank, ep_rank)'s slice of a full megatron state dict, with local expert indices."""
    if cfg.num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={cfg.num_experts}")
    a = arch.get(cfg.arch)
    per_rank = cfg.num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for key, t in full.items():
        if key.endswith(IGNORED_SUFFIXES):
            continue
        m = _EXPERT.match(key)
        if m:
            e = int(m.group(2))
            if e // per_rank == ep_rank:
                out[f"{m.group(1)}{e % per_rank}{m.group(3)}"] = t.clone()
        else:
            out[key] = tp_shard(t, a.tp_kind(key), tp_rank, tp).clone()
    return out


def load_into_megatron(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict`` that checks every weight by name and shape (``_extra_state`` aside)."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith(IGNORED_SUFFIXES)}
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
