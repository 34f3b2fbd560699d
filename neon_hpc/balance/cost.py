"""The cost model: how long one sequence (or one chunk of it) takes, forward + backward.

A sequence of ``n`` tokens costs ``a*n + b*n**2`` (+ ``image_cost`` per image):

* ``a`` is everything linear in tokens: attention projections (Q, K, V, O; GQA or MLA),
  the MLP (dense layers; MoE layers through ``top_k`` routed plus the shared experts, and
  the router), the LM head.  In FLOPs that is ``6 * active matmul parameters`` per token
  (2 for the forward multiply-add, 4 for the backward's two matmuls).
* ``b`` is causal attention: query ``p`` scores ``p + 1`` keys.  Per layer and per
  (query, key) pair the forward spends ``2*H*d_qk`` (QK^T) + ``2*H*d_v`` (AV) FLOPs, the
  backward twice that; a causal sequence has about ``n**2 / 2`` pairs, hence
  ``b = 3 * L * H * (d_qk + d_v)``  (``6*L*H*d`` when ``d_qk == d_v == d``).

Packed documents do not attend across their boundaries (varlen masks), so a micro-batch
costs the sum of its documents' costs.  A chunk ``[s, e)`` of a sequence (a piece split
off for context parallelism or across DP ranks) attends to the whole prefix ``[0, e)``:
it costs ``a*(e-s) + b*(e**2 - s**2)``, and the chunks of a sequence add up to the
whole.

Units are whatever ``a`` and ``b`` are in: FLOPs from :meth:`CostModel.from_model_config`,
seconds from ``neon-hpc costfit``.  The balancer only compares costs, so either
works; predicted step times are in the same unit.  A calibrated model also carries
``mb_overhead`` (per micro-batch) and ``piece_overhead`` (per document or piece: one
attention call per layer), which make packing many tiny documents, and cutting, cost
what they cost.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from neon_hpc.arch import DEFAULT as ARCH_DEFAULT, get as get_architecture


@dataclass(frozen=True)
class CostModel:
    a: float                          # per token
    b: float                          # per token pair (whole causal sequence: b * n**2)
    image_cost: float = 0.0           # per image (vision encoder), when present
    mb_overhead: float = 0.0          # per non-empty micro-batch (launch / framework cost)
    piece_overhead: float = 0.0       # per document or piece (one attention call per layer)
    source: str = "manual"            # where the numbers came from (config, calibration, ...)
    detail: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("a", "b", "image_cost", "mb_overhead", "piece_overhead"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")
        if self.a == 0 and self.b == 0:
            raise ValueError("CostModel: a and b are both 0; every assignment would cost nothing. "
                             "Derive them with CostModel.from_model_config or `neon-hpc costfit`")

    # ---- costs ------------------------------------------------------------------------
    def seq_cost(self, n: int, images: int = 0) -> float:
        """Cost of one whole sequence of ``n`` tokens (with ``images`` images)."""
        if n <= 0:
            return 0.0
        return self.piece_overhead + self.a * n + self.b * n * n + self.image_cost * images

    def chunk_cost(self, start: int, end: int) -> float:
        """Cost of tokens ``[start, end)`` of a sequence, attending to its prefix ``[0, end)``
        (each piece pays ``piece_overhead`` once: cutting a sequence is not free)."""
        if end <= start:
            return 0.0
        return self.piece_overhead + self.a * (end - start) + self.b * (end * end - start * start)

    def cost(self, lengths: Sequence[int], images: Sequence[int] | None = None) -> float:
        """Cost of a packed micro-batch: the sum of its documents' costs (no cross-document attention)."""
        n = np.asarray(lengths, dtype=np.float64)
        total = float(self.a * n.sum() + self.b * (n * n).sum() + self.piece_overhead * (n > 0).sum())
        if images is not None:
            total += self.image_cost * float(np.sum(images))
        return total

    def seq_costs(self, lengths: Sequence[int], images: Sequence[int] | None = None) -> np.ndarray:
        """Vectorised :meth:`seq_cost` over many sequences."""
        n = np.asarray(lengths, dtype=np.float64)
        c = self.a * n + self.b * n * n + self.piece_overhead * (n > 0)
        if images is not None:
            c = c + self.image_cost * np.asarray(images, dtype=np.float64)
        return c

    def crossover_tokens(self) -> float:
        """Length at which attention's quadratic term equals the linear term (``a / b``)."""
        return math.inf if self.b == 0 else self.a / self.b

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "<cost model>") -> "CostModel":
        known = {"a", "b", "image_cost", "mb_overhead", "piece_overhead", "source", "detail"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{where}: unknown cost-model keys {sorted(unknown)}; valid: {sorted(known)}")
        if "a" not in d or "b" not in d:
            raise ValueError(f"{where}: a cost model needs keys 'a' and 'b'")
        return cls(**{k: d[k] for k in known if k in d})

    # ---- from the architecture ----------------------------------------------------------
    @classmethod
    def from_model_config(cls, model_cfg, *, num_dense_layers: int | None = None,
                          num_shared_experts: int | None = None,
                          shared_expert_ffn_hidden_size: int | None = None,
                          q_lora_rank: int | None = None, kv_lora_rank: int | None = None,
                          qk_rope_head_dim: int | None = None, v_head_dim: int | None = None,
                          flops_per_second: float | None = None,
                          image_cost: float = 0.0) -> "CostModel":
        """Derive ``a`` and ``b`` (FLOPs, forward + backward) from a ``ModelConfig``.

        Fields the config does not carry are read with ``getattr`` under their usual names
        (``first_k_dense_replace``, ``moe_shared_expert_count``, ``q_lora_rank``, ...) and
        can be given here.  Defaults: Qwen3-MoE has no dense layers and no shared expert;
        DeepSeek-V3 has its first layer dense and one shared expert of the routed experts'
        width (``default_dense_layers``, ``default_shared_experts`` of :mod:`neon_hpc.arch`).
        MLA is used for an MLA architecture only when its ranks are known (config or
        arguments); otherwise attention is counted as GQA with ``head_dim``.
        ``flops_per_second`` turns FLOPs into seconds (e.g. measured MFU x peak).
        """
        f = flops_breakdown(model_cfg, num_dense_layers=num_dense_layers,
                            num_shared_experts=num_shared_experts,
                            shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size,
                            q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
        scale = 1.0 / flops_per_second if flops_per_second else 1.0
        return cls(a=f["a_flops"] * scale, b=f["b_flops"] * scale, image_cost=image_cost,
                   source="model_config" + ("/flops_per_second" if flops_per_second else ""),
                   detail=f)


def _pick(explicit, cfg, names, default):
    if explicit is not None:
        return explicit
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def flops_breakdown(cfg, *, num_dense_layers=None, num_shared_experts=None,
                    shared_expert_ffn_hidden_size=None, q_lora_rank=None, kv_lora_rank=None,
                    qk_rope_head_dim=None, v_head_dim=None) -> dict:
    """Active matmul parameters per token, by part, and the resulting ``a``/``b`` in FLOPs."""
    arch = getattr(cfg, "arch", ARCH_DEFAULT)
    facts = get_architecture(arch)          # its defaults for what the config does not carry
    h, L = cfg.hidden_size, cfg.num_layers
    H, G, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    dense_layers = _pick(num_dense_layers, cfg, ("first_dense_layers", "first_k_dense_replace", "num_dense_layers"),
                         facts.default_dense_layers)
    dense_layers = min(int(dense_layers), L)
    n_shared = _pick(num_shared_experts, cfg, ("moe_shared_expert_count", "num_shared_experts",
                                               "n_shared_experts"), facts.default_shared_experts)
    shared_ffn = _pick(shared_expert_ffn_hidden_size, cfg,
                       ("moe_shared_expert_intermediate_size", "shared_expert_ffn_hidden_size"),
                       cfg.moe_ffn_hidden_size)
    # ModelConfig writes "not MLA" as 0 for these (arch/model.py), other configs as absent
    q_lora = _pick(q_lora_rank, cfg, ("q_lora_rank",), None)
    kv_lora = _pick(kv_lora_rank, cfg, ("kv_lora_rank",), None) or None
    rope_d = _pick(qk_rope_head_dim, cfg, ("qk_rope_head_dim",), None) or None
    v_d = _pick(v_head_dim, cfg, ("v_head_dim",), d) or d

    att = facts.attention_params(h, H, G, d, q_lora=q_lora, kv_lora=kv_lora, rope_d=rope_d, v_d=v_d)
    attn_proj, d_qk, v_d = att.params, att.qk_head_dim, att.v_head_dim

    swiglu = 3 * h                                          # gate, up, down per hidden unit
    dense_mlp = swiglu * cfg.ffn_hidden_size
    moe_mlp = swiglu * cfg.moe_ffn_hidden_size * cfg.moe_router_topk \
        + swiglu * shared_ffn * n_shared + h * cfg.num_experts   # routed, shared, router
    lm_head = h * cfg.vocab_size
    moe_layers = L - dense_layers
    per_token_params = L * attn_proj + dense_layers * dense_mlp + moe_layers * moe_mlp + lm_head
    a_flops = 6.0 * per_token_params
    b_flops = 3.0 * L * H * (d_qk + v_d)
    return {
        "arch": arch, "attention": att.kind,
        "active_params_per_token": int(per_token_params),
        "attn_proj_params_per_layer": int(attn_proj), "dense_mlp_params_per_layer": int(dense_mlp),
        "moe_mlp_params_per_layer": int(moe_mlp), "lm_head_params": int(lm_head),
        "dense_layers": dense_layers, "moe_layers": moe_layers, "shared_experts": int(n_shared),
        "qk_head_dim": int(d_qk), "v_head_dim": int(v_d),
        "a_flops": a_flops, "b_flops": b_flops,
    }


def attention_flops(cfg, n: int) -> float:
    """Forward + backward FLOPs of causal attention scores and values for one sequence, counted
    pair by pair (``n*(n+1)/2`` query-key pairs): the reference the ``b`` term is checked against."""
    f = flops_breakdown(cfg)
    H, L = cfg.num_attention_heads, cfg.num_layers
    pairs = n * (n + 1) / 2
    fwd = L * pairs * 2 * H * (f["qk_head_dim"] + f["v_head_dim"])
    return 3.0 * fwd
