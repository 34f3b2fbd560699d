"""Local experts through one grouped GEMM per projection instead of megatron's loop of small ones.

megatron-core's local spec runs the experts of a MoE layer as ``SequentialMLP``: one ``MLP``
per local expert, called in a Python loop over the token dispatcher's per-expert splits.  At
32 experts that is 64 small GEMMs (plus the activation) per layer and direction, which is
what made the trainer's MoE layers slow on an H200 (issue 30).  megatron's own grouped
experts need Transformer Engine (``TEGroupedMLP``) or the ``grouped_gemm`` extension
(``GroupedMLP``), and change the parameter layout (one stacked tensor per projection).

:class:`GroupedExperts` keeps ``SequentialMLP``'s parameters exactly (``local_experts.N.
linear_fc1.weight`` / ``linear_fc2.weight``: checkpoints, HF mapping, reshard, DDP buckets and
router replay see no difference) and replaces only its forward: the local experts' weights are
stacked (a view-free copy, in the compute dtype: bf16 under mixed precision) and both
projections run as ``torch._grouped_mm`` over the dispatcher's token offsets; the gated SiLU
and the per-token router probabilities are applied exactly as megatron's ``MLP`` applies them
(probabilities after the activation, the product cast back to the activation's dtype).
``torch._grouped_mm`` runs on CUDA for bf16 inputs on SM >= 8.0 (its documented domain; Hopper
has the grouped kernel) and on CPU for fp32 and bf16 (forward and backward), so the same path is
what the CPU tests exercise.

Chosen by :func:`expert_impl` from the device and the parameters' dtype: ``grouped`` where
``torch._grouped_mm`` can run them, else megatron's ``SequentialMLP`` (fp32 training on CUDA;
the arithmetic is the same, and the tests compare the two).  With Transformer
Engine installed the choice is the same: TE's grouped linear would need TE's layer spec
throughout, which this trainer does not build (named in ``train/README.md``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

IMPLS = ("grouped", "sequential")


def expert_impl(cuda: bool, dtype: torch.dtype) -> str:
    """``"grouped"`` where ``torch._grouped_mm`` runs experts of ``dtype`` on this device (CPU:
    any float; CUDA: bf16 on SM >= 8.0), else ``"sequential"``."""
    if not hasattr(torch, "_grouped_mm"):
        return "sequential"
    if not cuda:
        return "grouped"
    return "grouped" if dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0) else "sequential"


def _stack(weights: list[torch.Tensor]) -> torch.Tensor:
    # [E, out, in] -> [E, in, out]: _grouped_mm computes x[offs_i:offs_i+1] @ w[i]
    return torch.stack(weights).transpose(1, 2)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` with the same parameters, run as two grouped GEMMs (see module docstring)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        cfg = self.config
        if cfg.moe_apply_probs_on_input or cfg.fp8 or cfg.fp4 or cfg.add_bias_linear \
                or not cfg.gated_linear_unit or cfg.activation_func is not F.silu \
                or cfg.activation_func_clamp_value is not None or cfg.glu_linear_offset:
            # the expert shape this module reproduces exactly; anything else is megatron's own loop
            raise ValueError("GroupedExperts runs SwiGLU experts without bias, fp8 or input-side "
                             "probabilities (the policy models' experts); build the model with "
                             "experts='sequential' for anything else")

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        counts = tokens_per_expert.to(device=x.device, dtype=torch.int64)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        w1 = _stack([e.linear_fc1.weight for e in self.local_experts]).to(x.dtype)
        w2 = _stack([e.linear_fc2.weight for e in self.local_experts]).to(x.dtype)
        h = torch._grouped_mm(x, w1, offs=offs)
        gate, up = torch.chunk(h, 2, dim=-1)
        act = F.silu(gate) * up
        act = (act * permuted_probs.unsqueeze(-1)).to(h.dtype)
        out = torch._grouped_mm(act.contiguous(), w2, offs=offs)
        return out, None


def hook_spec(spec) -> int:
    """Use :class:`GroupedExperts` wherever ``spec`` (a layer spec or a block spec with
    ``layer_specs``) has megatron's ``SequentialMLP``; returns how many were replaced."""
    layers = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    if layers is None:
        layers = getattr(spec, "layer_specs", None) or [spec]
    n = 0
    for layer in layers:
        mlp = getattr(layer.submodules, "mlp", None)
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is not None and getattr(experts, "module", None) is SequentialMLP:
            experts.module = GroupedExperts
            n += 1
    return n
