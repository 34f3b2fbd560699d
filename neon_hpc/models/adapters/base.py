"""What every architecture adapter provides, and the pure parts they share.

Nothing here imports torch, transformers or megatron at module level: the reshard tool (whose
``--dry-run`` imports not even torch) reads the same rule tables as the trainer's exporter.
Tensor helpers work on anything with torch's tensor methods and import nothing.

**The mapping.**  A :class:`Rule` turns one megatron weight (at a fixed layer, and expert for
expert weights) into HF weights:

* ``copy``    one HF tensor, the same values
* ``swiglu``  ``linear_fc1`` ``[gate; up]`` -> ``(gate_proj, up_proj)``, halves of the rows
* ``qkv``     fused ``linear_qkv``, per query group ``[q heads, k, v]`` -> ``(q, k, v)``
* ``vocab``   embeddings / output layer: HF keeps the first ``vocab_size`` rows (padding dropped)

``tp`` says how megatron splits the weight over tensor-parallel ranks (``rows``, ``cols``,
``swiglu``: each rank holds ``[its gate rows; its up rows]``; ``None``: replicated).  Rules
marked ``alias`` are other spellings of a weight (Transformer Engine's fused norms) that a
checkpoint may carry: read (megatron -> HF) only, never produced.

**Route layout.**  :class:`RouteLayout` is what SGLang sends per token: one row per decoder
layer (``num_hidden_layers``), zeros for layers that never route; the trainer's router replay
takes the MoE rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from neon_hpc.models.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]                # HF names, relative to the layer ("self_attn.o_proj.weight") or absolute (top)
    split: str = "copy"                # copy | swiglu | qkv | vocab
    tp: str | None = None              # None | rows | cols | swiglu
    alias: bool = False                # read-only spelling (TE fused norms)


@dataclass(frozen=True)
class QKVShape:
    groups: int
    q_per_group: int
    head_dim: int


class RouteLayoutError(ValueError):
    """Routes whose layer axis does not fit the model's route layout (not a per-token glitch)."""


@dataclass(frozen=True)
class RouteLayout:
    """Routed-expert rows per token on the wire, and which of them are MoE layers.

    SGLang's capturer has one row per decoder layer (``rows = num_hidden_layers``); layers
    that do not route (dense first layers) are zeros.  ``moe_rows`` are the decoder-layer
    indices of the MoE layers, in order: row ``moe_rows[j]`` feeds the trainer's ``j``-th router.
    """

    rows: int
    moe_rows: tuple[int, ...]

    def to_moe(self, routes: Any, where: str = "routed_experts") -> Any:
        """``[tokens, rows, top_k]`` (numpy) -> ``[tokens, len(moe_rows), top_k]``; raises on a wrong layout."""
        shape = tuple(getattr(routes, "shape", ()))
        if len(shape) != 3 or shape[1] != self.rows:
            got = shape[1] if len(shape) == 3 else shape
            hint = (" (one row per MoE layer: an engine that reports MoE layers only; SGLang and the embedded "
                    "engine send one row per decoder layer, zeros for dense layers)"
                    if len(shape) == 3 and shape[1] == len(self.moe_rows) and self.rows != len(self.moe_rows)
                    else "")
            raise RouteLayoutError(
                f"{where}: layer axis {got} rows, but the model's route layout has {self.rows} rows (one per "
                f"decoder layer, MoE layers at {list(self.moe_rows)}){hint}; does the engine serve the model in "
                f"model: (num_layers, first_dense_layers)?")
        if len(self.moe_rows) == self.rows:
            return routes
        return routes[:, list(self.moe_rows), :]

    def from_moe(self, moe_routes: Any) -> Any:
        """Inverse of :meth:`to_moe` (numpy): dense rows are zeros, as SGLang sends them."""
        import numpy as np
        r = np.asarray(moe_routes)
        out = np.zeros((r.shape[0], self.rows, r.shape[2]), dtype=r.dtype)
        out[:, list(self.moe_rows), :] = r
        return out


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
    """This TP rank's slice of a full megatron weight split ``kind`` (see :class:`Rule`)."""
    if kind is None or tp == 1:
        return t
    if kind == "rows":
        return t.chunk(tp, dim=0)[rank]
    if kind == "cols":
        return t.chunk(tp, dim=1)[rank]
    if kind == "swiglu":
        import torch
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    raise ValueError(f"unknown TP split {kind!r}")


def tp_join(parts: Sequence, kind: str | None):
    """Inverse of :func:`tp_shard` over all TP ranks' slices (in rank order)."""
    import torch
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
# the adapter interface

TOP_RULES: dict[str, Rule] = {
    "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",), "vocab", "rows"),
    "output_layer.weight": Rule(("lm_head.weight",), "vocab", "rows"),
    "decoder.final_layernorm.weight": Rule(("model.norm.weight",)),
}
# Expert weights: megatron ``...mlp.experts.local_experts.E.<suffix>`` (in memory) or
# ``...mlp.experts.experts.<suffix>`` with an expert axis (torch_dist); HF ``mlp.experts.E.<name>``.
EXPERT_RULES: dict[str, Rule] = {
    "linear_fc1.weight": Rule(("gate_proj.weight", "up_proj.weight"), "swiglu"),
    "linear_fc2.weight": Rule(("down_proj.weight",)),
}
# Norms and MLP weights every architecture here shares (local-spec names, then TE aliases).
COMMON_LAYER_RULES: dict[str, Rule] = {
    "input_layernorm.weight": Rule(("input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": Rule(("post_attention_layernorm.weight",)),
    "self_attention.linear_proj.weight": Rule(("self_attn.o_proj.weight",), tp="cols"),
    "mlp.router.weight": Rule(("mlp.gate.weight",)),
    "mlp.linear_fc1.weight": Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "swiglu", "swiglu"),
    "mlp.linear_fc2.weight": Rule(("mlp.down_proj.weight",), tp="cols"),
    "self_attention.linear_qkv.layer_norm_weight": Rule(("input_layernorm.weight",), alias=True),
    "mlp.linear_fc1.layer_norm_weight": Rule(("post_attention_layernorm.weight",), alias=True),
}


# megatron state-dict entries that carry no HF tensor (TE extra state, routing statistics)
IGNORED_SUFFIXES = ("_extra_state", "local_tokens_per_expert")


class Adapter:
    """One architecture: HF config, megatron config and spec, name rules, route layout."""

    name: str = ""
    hf_model_type: str = ""
    hf_architecture: str = ""
    layer_rules: dict[str, Rule] = {}
    expert_rules: dict[str, Rule] = EXPERT_RULES
    top_rules: dict[str, Rule] = TOP_RULES

    # --- pure -----------------------------------------------------------------------------
    def validate(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        return []

    def moe_layers(self, cfg: ModelConfig) -> list[int]:
        return list(range(cfg.num_layers))

    def experiment_errors(self, exp: Any) -> list[tuple[str, str]]:
        """``[(key path, message)]``: what this architecture refuses in the rest of an experiment
        config (trainer layout, balancer); ``neon-hpc config check`` reports them."""
        return []

    def route_layout(self, cfg: ModelConfig) -> RouteLayout:
        return RouteLayout(rows=cfg.num_layers, moe_rows=tuple(self.moe_layers(cfg)))

    def hf_config_dict(self, cfg: ModelConfig) -> dict:
        raise NotImplementedError

    def model_config_from_hf(self, hf_cfg: Any) -> ModelConfig:
        raise NotImplementedError

    def qkv_shape(self, cfg: ModelConfig) -> QKVShape | None:
        return None

    def layer_suffixes(self, cfg: ModelConfig, layer: int) -> list[str]:
        """The megatron (local spec) weight suffixes of decoder layer ``layer``, experts aside."""
        raise NotImplementedError

    def tp_kind(self, key: str) -> str | None:
        """How the megatron weight ``key`` (full name) is split over TP; None = replicated."""
        if key in self.top_rules:
            return self.top_rules[key].tp
        if ".mlp.experts." in key:
            return None                      # expert TP is 1
        parts = key.split(".")
        if key.startswith("decoder.layers.") and len(parts) > 3 and parts[2].isdigit():
            rule = self.layer_rules.get(".".join(parts[3:]))
            return rule.tp if rule else None
        return None

    # --- heavy (lazy imports) ---------------------------------------------------------------
    def hf_model_class(self):
        import transformers
        return getattr(transformers, self.hf_architecture)

    def hf_config(self, cfg: ModelConfig):
        from transformers import AutoConfig
        d = self.hf_config_dict(cfg)
        d = {k: v for k, v in d.items() if k != "model_type"}
        return AutoConfig.for_model(self.hf_model_type, **d)

    def build_hf_model(self, cfg: ModelConfig, seed: int | None = None):
        """A freshly initialised HF model (float32, eval mode); no download."""
        import torch
        torch.manual_seed(cfg.seed if seed is None else seed)
        return self.hf_model_class()(self.hf_config(cfg)).eval()

    def hf_routers(self, model) -> list[tuple[int, Any]]:
        """``(decoder layer, router module)`` of an HF model; each router's forward returns
        ``(logits, weights, top-k indices)``."""
        out = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                out.append((i, gate))
        return out

    def transformer_config(self, cfg: ModelConfig, tp: int, ep: int, routing_replay: bool, base: dict,
                           overrides: Mapping[str, Any]):
        raise NotImplementedError

    def layer_spec(self, cfg: ModelConfig, tcfg):
        raise NotImplementedError
