"""What an architecture tells the rest of neon-hpc: one interface, one object per architecture
folder (``neon_hpc/arch/<name>/``), looked up by name in ``neon_hpc.arch``.

Pure: nothing here imports torch, transformers or megatron (the reshard tool's ``--dry-run``
imports not even torch).  The megatron side of an architecture (TransformerConfig, layer spec)
is ``neon_hpc/arch/<name>/megatron.py`` (:attr:`Architecture.megatron_module`), which only
``neon_hpc.models`` imports.

**Route rows.**  :class:`RouteRows` is what SGLang sends per token: one row per decoder
layer (``num_hidden_layers``), zeros for layers that never route; the trainer's router replay
takes the MoE rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Literal, Mapping, Protocol

from neon_hpc.arch.rules import EXPERT_RULES, TOP_RULES, NameRule, QKVShape


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


class RouteRowsError(ValueError):
    """Routes whose layer axis does not fit the model's route rows (not a per-token glitch)."""


@dataclass(frozen=True)
class RouteRows:
    """Routed-expert rows per token on the wire, and which of them are MoE layers.

    SGLang's capturer has one row per decoder layer (``rows = num_hidden_layers``); layers
    that do not route (dense first layers) are zeros.  ``moe_rows`` are the decoder-layer
    indices of the MoE layers, in order: row ``moe_rows[j]`` feeds the trainer's ``j``-th router.
    """

    rows: int
    moe_rows: tuple[int, ...]

    def to_moe(self, routes: Any, where: str = "routed_experts") -> Any:
        """``[tokens, rows, top_k]`` (numpy) -> ``[tokens, len(moe_rows), top_k]``; raises on a wrong layer axis."""
        shape = tuple(getattr(routes, "shape", ()))
        if len(shape) != 3 or shape[1] != self.rows:
            got = shape[1] if len(shape) == 3 else shape
            hint = (" (one row per MoE layer: an engine that reports MoE layers only; SGLang and the embedded "
                    "engine send one row per decoder layer, zeros for dense layers)"
                    if len(shape) == 3 and shape[1] == len(self.moe_rows) and self.rows != len(self.moe_rows)
                    else "")
            raise RouteRowsError(
                f"{where}: layer axis {got} rows, but the model has {self.rows} route rows (one per "
                f"decoder layer, MoE layers at {list(self.moe_rows)}){hint}; does the engine serve the model in "
                f"model: (num_layers, first_dense_layers)?")
        if len(self.moe_rows) == self.rows:
            return routes
        return routes[:, list(self.moe_rows), :]

    def from_moe(self, moe_routes: Any) -> Any:
        """Inverse of :meth:`to_moe` (numpy): dense rows are zeros, as SGLang sends them."""
        import numpy as np  # deferred: heavy (numpy)
        r = np.asarray(moe_routes)
        out = np.zeros((r.shape[0], self.rows, r.shape[2]), dtype=r.dtype)
        out[:, list(self.moe_rows), :] = r
        return out


class Architecture:
    """One architecture's facts.  Subclasses set the class attributes and override what differs:
    the config rules, ``layer_suffixes``, ``fields_from_shapes`` (and, for MLA, the FLOP and
    KV-cache terms); their folder's ``megatron.py`` builds the megatron config and spec."""

    name: ClassVar[str]                      # the config's ``model.arch``, the mapping's name
    aliases: ClassVar[tuple[str, ...]] = ()  # other ``model.arch`` / HF ``model_type`` values with these weights
    mapping: ClassVar[ModuleType]            # ``<name>/hfmap.py``: weight-name rules and config.json fields
    expert_rules: ClassVar[dict[str, NameRule]] = EXPERT_RULES   # the rules every architecture shares (rules.py)
    top_rules: ClassVar[dict[str, NameRule]] = TOP_RULES
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
        """The whole ``config.json`` of a ``model:`` section (what the trainer writes and reshard reads)."""
        return self.mapping.hf_config_dict(cfg)

    def model_config_from_hf(self, hf_cfg: Any) -> Any:
        """The ``model:`` section (a ModelConfig) of an HF config (a dict or a transformers config)."""
        return self.mapping.model_config_from_hf(hf_cfg)

    def qkv_shape(self, cfg: Any) -> QKVShape | None:
        """The per-group layout of a fused ``linear_qkv`` (None: the architecture has none)."""
        return None

    def layer_suffixes(self, cfg: Any, layer: int) -> list[str]:
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

    # --- the megatron side (megatron.py: imported by neon_hpc.models only) ------------------
    @property
    def megatron_module(self) -> str:
        """The module of this folder's megatron builders, ``transformer_config`` and ``layer_spec``."""
        return f"{type(self).__module__}.megatron"

    # --- layers -----------------------------------------------------------------------------
    def dense_layers(self, cfg: Any) -> int:
        """Dense first layers of a ``model:`` section (a ModelConfig)."""
        return self.default_dense_layers

    def moe_layers(self, cfg: Any) -> list[int]:
        """Decoder layers that route (the rows of a trajectory's routes the trainer replays)."""
        return list(range(min(self.dense_layers(cfg), cfg.num_layers), cfg.num_layers))

    def shared_experts(self, cfg: Any) -> int:
        return self.default_shared_experts

    def route_rows(self, cfg: Any) -> RouteRows:
        """The route rows of a ``model:`` section: one per decoder layer, the MoE ones marked."""
        return RouteRows(rows=cfg.num_layers, moe_rows=tuple(self.moe_layers(cfg)))

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
