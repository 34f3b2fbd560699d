"""The ``model:`` section's common part: :class:`ModelConfig`, what every MoE architecture has.

Each architecture's folder subclasses it with its own fields and rules
(``neon_hpc/arch/<name>/config.py``: the ``arch`` tag, MLA dims, dense layers, ...) and names the
subclass in its :class:`~neon_hpc.arch.base.Architecture` (``config``, ``model_errors``,
``experiment_errors``).  ``neon_hpc.config.model`` assembles the discriminated union the
experiment config validates.  ``ModelConfig(arch=A, ...)`` builds architecture ``A``'s section
(the registry's default without ``arch``).

Pure arithmetic on the config: no torch, nothing of the megatron side.  The registry
(``neon_hpc.arch``) imports every folder, whose config subclasses this class, so this module
reads the registry at call time only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import model_validator

from neon_hpc import arch as registry  # partly initialised while the folders import: read at call time
from neon_hpc.util.constraints import Rule, above, at_least

Errors = list[tuple[str, str]]


@dataclass
class ModelConfig:
    """What every MoE architecture has, from which both the HF and the megatron-core models are
    built.  ``ModelConfig(arch=A, ...)`` builds the section of architecture ``A``."""

    arch: str = ""                      # each architecture's section sets its tag (a Literal) and default
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2           # KV heads (GQA); multi-latent attention needs it equal to the heads
    head_dim: int = 16                  # GQA attention's head dim (MLA uses its qk_*/v_head_dim fields)
    ffn_hidden_size: int = 128          # dense layers (DeepSeek-style first layers)
    moe_ffn_hidden_size: int = 64
    num_experts: int = 4
    moe_router_topk: int = 2
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_epsilon: float = 1e-6
    init_checkpoint: str = ""           # HF or torch_dist path to start from; "" = random init from seed
    # the rollout's tokenizer: "xrd-tiny" (built in, 256 ids), a directory or file with
    # neon_tokenizer.json, a local HF tokenizer directory, or "" = the one saved in init_checkpoint
    tokenizer: str = "xrd-tiny"
    seed: int = 1234

    TAG_FIELD = "arch"
    CHECKS = {
        **{k: at_least(1) for k in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                    "num_query_groups", "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size",
                                    "num_experts", "moe_router_topk", "max_position_embeddings")},
        "rope_theta": above(0),
        "norm_epsilon": above(0, le=1.0),
    }
    RULES = (
        Rule("num_attention_heads", lambda c: c.num_attention_heads % c.num_query_groups == 0,
             "a multiple of num_query_groups ({num_query_groups})"),
        Rule("moe_router_topk", lambda c: c.moe_router_topk <= c.num_experts, "in 1..num_experts ({num_experts})"),
        # the architecture's own rules (MLA dims, dense layers, router groups, ...): its folder's config.py
        Rule("arch", lambda c: not arch_errors(c), lambda c: "; ".join(f"model.{k}: {m}" for k, m in arch_errors(c))),
    )

    @property
    def tokenizer_source(self) -> str:
        """What the rollout side loads its tokenizer from: ``tokenizer``, or where it is ``""``
        the one saved beside ``init_checkpoint``."""
        return self.tokenizer or self.init_checkpoint

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is ModelConfig:           # the architecture's own section
            cls = section_of(kwargs.get("arch") or registry.DEFAULT)
        return object.__new__(cls)

    # run.yaml files written before the model section was split per architecture list every
    # architecture's fields; one of another architecture's fields at its neutral value (its
    # default: no MLA, no dense layer, no shared expert, no YaRN) says nothing about this model
    # and is dropped, so a resumed run loads; any other value is refused by name (a field of
    # that architecture)
    @model_validator(mode="before")
    @classmethod
    def _neutral_foreign_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict) or cls is ModelConfig:
            return data
        own = {f.name for f in dataclasses.fields(cls)}
        neutral = {f.name: f.default for a in registry.ARCHITECTURES.values() if a.config is not cls
                   for f in dataclasses.fields(a.config) if f.name not in own}
        return {k: v for k, v in data.items()
                if not (k in neutral and type(v) is type(neutral[k]) and v == neutral[k])}


def section_of(name: str) -> type:
    """The section class of architecture ``name`` (``ValueError`` naming the registered ones)."""
    try:
        return registry.get(name).config
    except ValueError:
        raise ValueError(f"unknown model.arch {name!r}; supported: {registry.known()}") from None


def as_arch(cfg: ModelConfig, name: str, **changes: Any) -> ModelConfig:
    """``cfg``'s common fields (and ``changes``) in the section of architecture ``name``."""
    common = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{**common, "arch": name, **changes})


def arch_errors(cfg: ModelConfig, name: str | None = None) -> Errors:
    """``[(field, message)]``: what architecture ``name`` (default ``cfg.arch``) refuses in ``cfg``
    (empty when the model fits it)."""
    return registry.get(name or cfg.arch).model_errors(cfg)


def arch_experiment_errors(exp: Any, name: str | None = None) -> Errors:
    """``[(key path, message)]``: what architecture ``name`` (default ``exp.model.arch``) refuses in
    the rest of the experiment config ``exp`` (trainer layout); ``neon-hpc config check`` reports them."""
    return registry.get(name or exp.model.arch).experiment_errors(exp)
