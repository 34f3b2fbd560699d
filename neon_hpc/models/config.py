"""Model section of the experiment config (owned by ``neon_hpc/models``): one section per
architecture, chosen by ``model.arch`` (a discriminated union, :data:`ModelSection`).

:class:`ModelConfig` holds what every MoE architecture has; :class:`Qwen3MoeConfig` (GQA, every
layer MoE) and :class:`DeepSeekV3Config` (multi-latent attention, dense first layers, shared
experts, grouped sigmoid router, YaRN; ``arch: kimi_k2`` is the same section) add their own
fields, so a DeepSeek-only key under ``arch: qwen3_moe`` is refused with the fix.  Code that
builds one writes ``ModelConfig(arch=..., ...)`` and gets the architecture's class.

The architectures' own config rules are here too, beside the sections they check (pure
arithmetic on the config: no torch, nothing of the adapters): :data:`ARCH_RULES` holds, per
architecture, its rules on the ``model:`` section (each section's ``arch`` rule runs them) and on
the rest of an experiment (``neon_hpc.config`` runs those with the cross-section rules).  The
adapters (:mod:`neon_hpc.models.adapters`) answer ``validate`` / ``experiment_errors`` from this
table.
"""
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import model_validator

from neon_hpc import hfmap
from neon_hpc.constraints import Rule, above, at_least, section, union_of

Errors = list[tuple[str, str]]

DEFAULT_ARCH = "qwen3_moe"


@dataclass
class ModelConfig:
    """What every MoE architecture has, from which both the HF and the megatron-core models are
    built.  ``ModelConfig(arch=A, ...)`` builds the section of architecture ``A``."""

    arch: str = DEFAULT_ARCH
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2           # qwen3_moe: KV heads (GQA); deepseek_v3 (MLA): must equal the heads
    head_dim: int = 16                  # qwen3_moe's attention (MLA uses the qk_*/v_head_dim fields)
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
        # the architecture's own rules (MLA dims, dense layers, router groups, ...): ARCH_RULES below
        Rule("arch", lambda c: not arch_errors(c), lambda c: "; ".join(f"model.{k}: {m}" for k, m in arch_errors(c))),
    )

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is ModelConfig:           # the architecture's own section
            cls = section_of(kwargs.get("arch", DEFAULT_ARCH))
        return object.__new__(cls)


@section
@dataclass
class Qwen3MoeConfig(ModelConfig):
    """Qwen3-MoE: GQA attention with per-head QK norm, every layer MoE, softmax top-k router."""

    arch: Literal["qwen3_moe"] = "qwen3_moe"

    # run.yaml files written before the model section was split per architecture list every
    # DeepSeek-V3 field; at its neutral value (its default: no MLA, no dense layer, no shared
    # expert, no YaRN) one says nothing about a Qwen3 model and is dropped, so a resumed run
    # loads; any other value is refused by name (a field of arch deepseek_v3)
    @model_validator(mode="before")
    @classmethod
    def _neutral_deepseek_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        neutral = {f.name: f.default for f in dataclasses.fields(DeepSeekV3Config)
                   if f.name not in _COMMON and f.name != "arch"}
        return {k: v for k, v in data.items()
                if not (k in neutral and type(v) is type(neutral[k]) and v == neutral[k])}


@section
@dataclass
class DeepSeekV3Config(ModelConfig):
    """DeepSeek-V3 / Kimi-K2: multi-latent attention, dense first layers, shared experts, sigmoid
    router with expert-score bias and grouped top-k, optional YaRN RoPE scaling."""

    arch: Literal["deepseek_v3", "kimi_k2"] = "deepseek_v3"   # kimi_k2 = deepseek_v3
    q_lora_rank: int = 0                # 0 = no query compression (one linear_q_proj)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_dense_layers: int = 0         # HF first_k_dense_replace
    num_shared_experts: int = 0         # shared expert width = num_shared_experts * moe_ffn_hidden_size
    router_groups: int = 1              # HF n_group
    router_group_topk: int = 1          # HF topk_group
    routed_scaling_factor: float = 1.0
    # YaRN RoPE scaling (HF rope_parameters rope_type "yarn"); yarn_factor 0 = plain RoPE
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0


_COMMON = frozenset(f.name for f in dataclasses.fields(ModelConfig))

# model.arch -> its section (kimi_k2 ships DeepSeek-V3 weights: the same section)
SECTIONS: dict[str, type] = {"qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepSeekV3Config}
ARCH_ALIASES = {"kimi_k2": "deepseek_v3"}
# the ``model:`` section's type: the architecture's section, chosen by its ``arch`` key
ModelSection = union_of(SECTIONS, "arch", DEFAULT_ARCH, ARCH_ALIASES)


def section_of(arch: str) -> type:
    """The section class of architecture ``arch`` (``ValueError`` naming the supported ones)."""
    try:
        return SECTIONS[ARCH_ALIASES.get(arch, arch)]
    except KeyError:
        raise ValueError(f"unknown model.arch {arch!r}; supported: {', '.join([*SECTIONS, *ARCH_ALIASES])}") from None


def as_arch(cfg: ModelConfig, arch: str, **changes: Any) -> ModelConfig:
    """``cfg``'s common fields (and ``changes``) in the section of architecture ``arch``."""
    common = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{**common, "arch": arch, **changes})


# --------------------------------------------------------------------------------------
# the architectures' rules

def _qwen3_moe_errors(cfg: ModelConfig) -> Errors:
    errs = []
    if cfg.num_attention_heads % cfg.num_query_groups:
        errs.append(("num_attention_heads", f"must be a multiple of num_query_groups ({cfg.num_query_groups})"))
    if cfg.head_dim <= 0:
        errs.append(("head_dim", "must be positive"))
    return errs   # the deepseek_v3 fields are not fields of this section: the loader refuses them by name


def _deepseek_v3_errors(cfg: ModelConfig) -> Errors:
    """DeepSeek-V3 / Kimi-K2 (the semantics are pinned in :mod:`neon_hpc.models.adapters.deepseek_v3`)."""
    errs = []
    unset = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if getattr(cfg, k) < 1]
    if unset:
        errs.append((unset[0], f"multi-latent attention needs {', '.join(unset)} >= 1 (DeepSeek-V3/Kimi-K2: "
                               f"kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)"))
    if cfg.qk_rope_head_dim % 2:
        errs.append(("qk_rope_head_dim", "must be even (RoPE rotates pairs)"))
    if cfg.num_query_groups != cfg.num_attention_heads:
        errs.append(("num_query_groups", f"MLA has one latent KV per head: set it to num_attention_heads "
                                         f"({cfg.num_attention_heads})"))
    if not 0 <= cfg.first_dense_layers < cfg.num_layers:
        errs.append(("first_dense_layers", f"must be in [0, num_layers={cfg.num_layers}) (at least one MoE layer)"))
    g, gk = cfg.router_groups, cfg.router_group_topk
    if g < 1 or cfg.num_experts % g:
        errs.append(("router_groups", f"must divide num_experts ({cfg.num_experts})"))
    elif not 1 <= gk <= g:
        errs.append(("router_group_topk", f"must be in 1..router_groups ({g})"))
    elif g > 1 and cfg.moe_router_topk != 2 * gk:
        errs.append(("router_group_topk", f"with router_groups > 1 megatron scores a group by its top "
                                          f"topk/group_topk experts and HF by its top 2: needs moe_router_topk "
                                          f"({cfg.moe_router_topk}) == 2 * router_group_topk"))
    elif g > 1 and cfg.num_experts // g < 2:
        errs.append(("router_groups", "each group needs at least 2 experts"))
    if cfg.routed_scaling_factor <= 0:
        errs.append(("routed_scaling_factor", "must be > 0"))
    if cfg.yarn_factor and cfg.yarn_factor < 1:
        errs.append(("yarn_factor", "0 (plain RoPE) or >= 1"))
    return errs


def _deepseek_v3_experiment_errors(exp: Any) -> Errors:
    cfg, t = exp.model, exp.train
    errs = []
    tp = t.tensor_parallel
    for k, n in (("num_attention_heads", cfg.num_attention_heads),
                 ("kv_lora_rank + qk_rope_head_dim", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                 ("q_lora_rank", cfg.q_lora_rank or tp)):
        if n % tp:
            errs.append(("train.tensor_parallel", f"{tp} must divide model.{k} ({n}): the local spec "
                                                  f"column-splits every MLA projection"))
    return errs


def _none(_cfg: Any) -> Errors:
    return []


# architecture (neon_hpc.hfmap's name) -> (rules on its model section -> [(field, message)],
#                                           rules on the rest of an experiment -> [(key path, message)])
ARCH_RULES: dict[str, tuple[Callable[[ModelConfig], Errors], Callable[[Any], Errors]]] = {
    "qwen3_moe": (_qwen3_moe_errors, _none),
    "deepseek_v3": (_deepseek_v3_errors, _deepseek_v3_experiment_errors),
}


def _rules(arch: str):
    return ARCH_RULES[hfmap.table(arch).NAME]        # kimi_k2 -> deepseek_v3; ValueError naming the arches


def arch_errors(cfg: ModelConfig, arch: str | None = None) -> Errors:
    """``[(field, message)]``: what architecture ``arch`` (default ``cfg.arch``) refuses in ``cfg``
    (empty when the model fits it)."""
    return _rules(arch or cfg.arch)[0](cfg)


def arch_experiment_errors(exp: Any, arch: str | None = None) -> Errors:
    """``[(key path, message)]``: what architecture ``arch`` (default ``exp.model.arch``) refuses in
    the rest of the experiment config ``exp`` (trainer layout); ``neon-hpc config check`` reports them."""
    return _rules(arch or exp.model.arch)[1](exp)
