"""What an architecture tells the rest of neon-hpc: one small interface, one object per
architecture folder (``neon_hpc/arch/<name>/``), looked up by name in ``neon_hpc.arch``.

Pure: nothing here imports torch, transformers or megatron (the reshard tool's ``--dry-run``
imports not even torch).  The megatron side of an architecture (config, layer spec, HF model
class) is ``neon_hpc/arch/<name>/megatron.py``, which only ``neon_hpc.models`` imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Literal, Mapping, Protocol


class ShapeError(ValueError):
    """A checkpoint's shapes lack what an architecture needs to derive its HF fields."""


class Shapes(Protocol):
    """What :meth:`Architecture.fields_from_shapes` may ask of a checkpoint (reshard's ``Checkpoint``)."""

    def layer(self, suffix: str) -> tuple[int, ...] | None:
        """Shape of a decoder-layer weight ``decoder.layers.<i>.<suffix>``, without the layer axis."""

    def tensor(self, key: str) -> tuple[int, ...] | None:
        """Shape of the whole tensor ``key`` (None: absent)."""

    def dense_layers(self) -> list[int]:
        """Decoder layers with a dense MLP (``mlp.linear_fc1``), ascending."""


@dataclass(frozen=True)
class AttentionParams:
    """One layer's attention projections, for FLOP counts: matmul parameters (Q, K, V, O and any
    low-rank stages), the query/key and value head dims of the score and value products, and
    which attention was counted (``gqa`` or ``mla``)."""

    params: int
    qk_head_dim: int
    v_head_dim: int
    kind: str


class Architecture:
    """One architecture's facts.  Subclasses set the class attributes and the two methods."""

    name: ClassVar[str]                      # the config's ``model.arch``, the mapping's name
    aliases: ClassVar[tuple[str, ...]] = ()  # other ``model.arch`` / HF ``model_type`` values with these weights
    mapping: ClassVar[ModuleType]            # ``<name>/hfmap.py``: weight-name rules and config.json fields
    config: ClassVar[type]                   # ``<name>/config.py``: its ``model:`` section (a ModelConfig subclass)
    attention: ClassVar[Literal["gqa", "mla"]]
    # when a config does not say: dense first layers, and shared experts per MoE layer
    default_dense_layers: ClassVar[int] = 0
    default_shared_experts: ClassVar[int] = 0
    # reshard: config.json fields the shapes of a checkpoint decide (checked against them) ...
    shape_fields: ClassVar[tuple[str, ...]] = ()
    # ... and those the shapes cannot tell, guessed when a config is derived from shapes
    guessed_fields: ClassVar[tuple[str, ...]] = ()
    # guessed too, named by the shape derivation itself (before the generic ones)
    derive_guessed: ClassVar[tuple[str, ...]] = ()

    # --- the config section's rules (config.py) ------------------------------------------------
    def model_errors(self, cfg: Any) -> list[tuple[str, str]]:
        """``[(field, message)]``: what this architecture refuses in a ``model:`` section."""
        return []

    def experiment_errors(self, exp: Any) -> list[tuple[str, str]]:
        """``[(key path, message)]``: what it refuses in the rest of an experiment (trainer layout)."""
        return []

    # --- the mapping (hfmap.py) ---------------------------------------------------------------
    @property
    def hf_model_type(self) -> str:
        return self.mapping.HF_MODEL_TYPE

    @property
    def hf_architecture(self) -> str:
        return self.mapping.HF_ARCHITECTURE

    @property
    def layer_rules(self) -> dict:
        return self.mapping.LAYER_RULES

    def hf_fields(self, values: Mapping[str, Any]) -> dict:
        return self.mapping.hf_fields(values)

    def hf_config_dict(self, cfg: Any) -> dict:
        return self.mapping.hf_config_dict(cfg)

    # --- layers -----------------------------------------------------------------------------
    def dense_layers(self, cfg: Any) -> int:
        """Dense first layers of a ``model:`` section (a ModelConfig)."""
        return self.default_dense_layers

    def moe_layers(self, cfg: Any) -> list[int]:
        """Decoder layers that route (the rows of a trajectory's routes the trainer replays)."""
        return list(range(min(self.dense_layers(cfg), cfg.num_layers), cfg.num_layers))

    def shared_experts(self, cfg: Any) -> int:
        return self.default_shared_experts

    # --- FLOP and memory terms -------------------------------------------------------------
    def attention_params(self, h: int, heads: int, groups: int, head_dim: int, *, q_lora: int | None,
                         kv_lora: int | None, rope_d: int | None, v_d: int) -> AttentionParams:
        """GQA: Q and O of ``heads``, K and V of ``groups`` (MLA architectures override; the ranks
        are ignored here)."""
        return AttentionParams(h * heads * head_dim + 2 * h * groups * head_dim + heads * head_dim * h,
                               head_dim, head_dim, "gqa")

    def kv_cache_values_per_token_layer(self, cfg: Any, attn_tp: int) -> float:
        """KV-cache values one GPU holds per token and layer: K and V of ``num_query_groups`` heads,
        sharded over the attention TP group (MLA architectures override: one latent, replicated)."""
        groups = max(cfg.num_query_groups or cfg.num_attention_heads, 1)
        return 2.0 * groups * cfg.head_dim / min(max(attn_tp, 1), groups)

    # --- reshard ----------------------------------------------------------------------------
    def fields_from_shapes(self, shapes: Shapes, proj, fc1) -> dict:
        """ModelConfig fields the checkpoint's shapes give (``proj``: ``linear_proj``'s per-layer
        shape, ``fc1``: the routed experts' ``linear_fc1``); ShapeError when they cannot."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<architecture {self.name}>"
