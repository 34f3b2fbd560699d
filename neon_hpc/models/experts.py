"""Local experts through one grouped GEMM per projection instead of megatron's loop of small ones.

megatron-core's local spec runs the experts of a MoE layer as ``SequentialMLP``: one ``MLP``
per local expert, called in a Python loop over the token dispatcher's per-expert splits.  At
32 experts that is 64 small GEMMs (plus the activation) per layer and direction, which is
what made the trainer's MoE layers slow on an H200 (issue 30).  megatron's own grouped
experts need Transformer Engine (``TEGroupedMLP``) or the ``grouped_gemm`` extension
(``GroupedMLP``), and change the parameter layout (one stacked tensor per projection).

:class:`GroupedExperts` keeps ``SequentialMLP``'s parameters exactly (``local_experts.N.
linear_fc1.weight`` / ``linear_fc2.weight``: checkpoints, HF mapping, reshard, DDP buckets and
router replay see no difference) and replaces only its forward.  Each projection's expert
weights are views of one ``[E, out, in]`` storage (:meth:`GroupedExperts.link`, at build and
after every ``.cuda()`` / ``.to()``), which feeds ``torch._grouped_mm`` as a transposed view,
with no copy (issue 40: ``torch.stack`` in every forward was ~400 MB of traffic per layer at
1.8 B and 3.2 GB kept for backward); one autograd node (``_ExpertStack``) hands each expert its
slice of the weight gradient.  Both projections run as ``torch._grouped_mm`` over the
dispatcher's token offsets, computed on the device from its device counts.  The gated SiLU and
the per-token router probabilities run as one fused function, ``silu(gate) * up * probs`` with
the probabilities cast to the activation's dtype first (bf16 under mixed precision; megatron's
``MLP`` multiplies in fp32 and casts back, the same to 2e-2 in bf16 and bit-identical in fp32),
through megatron's ``jit_fuser``: ``torch.compile`` on CUDA, eager on CPU, where the CPU shim
turns compilation off (an inductor C++ compile per shape costs more than a CPU step).

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


class _ExpertStack(torch.autograd.Function):
    """The ``[E, out, in]`` storage that the experts' weights are views of, as one autograd node:
    forward returns it as it is (no copy), backward hands each expert its slice of the gradient."""

    @staticmethod
    def forward(ctx, stacked: torch.Tensor, into_main: bool, *weights: torch.Tensor) -> torch.Tensor:
        # into_main: megatron DDP without overlapped reduction owns the weights' ``main_grad``;
        # backward adds the slices there in one multi-tensor op (what DDP's per-parameter hook
        # would do, one ``add_`` per expert) and produces no ``.grad``, so no hook runs for them
        ctx.weights = weights if into_main else None
        return stacked.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.weights is not None:
            mains = [w.main_grad for w in ctx.weights]
            torch._foreach_add_(mains, grad.to(mains[0].dtype).unbind(0))
            return (None, None, *(None for _ in ctx.weights))
        return (None, None, *grad.unbind(0))


def _is_stack_of(weights: list[torch.Tensor], stacked: torch.Tensor | None) -> bool:
    """Whether each of ``weights`` is still row ``i`` of ``stacked`` (nobody re-pointed ``.data``).
    Compared by storage and offset, not data pointer, so that fake tensors compare too."""
    if stacked is None or stacked.shape[0] != len(weights) or stacked.dtype != weights[0].dtype:
        return False
    storage, base, step = stacked.untyped_storage()._cdata, stacked.storage_offset(), stacked.stride(0)
    return all(w.untyped_storage()._cdata == storage and w.storage_offset() == base + i * step
               and w.shape == stacked.shape[1:] and w.stride() == stacked.stride()[1:]
               for i, w in enumerate(weights))


def swiglu_probs(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * probs`` in ``h``'s dtype (the probabilities cast to it first)."""
    gate, up = torch.chunk(h, 2, dim=-1)
    return F.silu(gate) * up * probs.to(h.dtype).unsqueeze(-1)


_FUSED: dict[str, object] = {}


def fused_swiglu_probs():
    """:func:`swiglu_probs` through megatron's ``jit_fuser``, looked up at the first call:
    ``torch.compile`` on CUDA (one kernel forward, one backward), the eager function where the
    CPU shim has turned compilation off (``models/cpu_shim.py``: an inductor C++ compile per
    shape would cost more than a CPU step)."""
    if "f" not in _FUSED:
        from megatron.core import jit  # deferred: heavy (megatron)
        _FUSED["f"] = jit.jit_fuser(swiglu_probs)
    return _FUSED["f"]


PROJECTIONS = ("linear_fc1", "linear_fc2")


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
        self._stacks: dict[str, torch.Tensor] = {}
        self.stack_fallbacks = 0
        # set by train/backend.py once megatron's DDP (overlap_grad_reduce off) holds the weights'
        # main_grad: the weight gradients then go there directly (see _ExpertStack)
        self.grads_into_main_grad = False
        self.link()

    def _weights(self, name: str) -> list[torch.Tensor]:
        return [getattr(e, name).weight for e in self.local_experts]

    def link(self) -> None:
        """Make each projection's expert weights views of one ``[E, out, in]`` storage (same
        values, same ``Parameter`` objects: optimizer, DDP hooks and state-dict keys see no change)."""
        for name in PROJECTIONS:
            ws = self._weights(name)
            if _is_stack_of(ws, self._stacks.get(name)):
                continue
            stacked = torch.stack([w.detach() for w in ws])
            for w, row in zip(ws, stacked.unbind(0)):
                w.data = row
            self._stacks[name] = stacked

    def _apply(self, fn, recurse=True):
        # .cuda() / .to() / .bfloat16() give every parameter its own new storage: link them again
        out = super()._apply(fn, recurse=recurse)
        self.link()
        return out

    def stacked(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``[E, in, out]`` weights of projection ``name`` for ``torch._grouped_mm``: a transposed
        view of the experts' storage (a copy only where ``dtype`` differs from the parameters'),
        or, where something re-pointed the parameters' ``.data`` since :meth:`link` (megatron's
        distributed optimizer maps them into its own buffer), a stack of them."""
        ws = self._weights(name)
        stacked = self._stacks.get(name)
        if _is_stack_of(ws, stacked):
            into_main = self.grads_into_main_grad and torch.is_grad_enabled() \
                and all(w.requires_grad and getattr(w, "main_grad", None) is not None for w in ws)
            w = _ExpertStack.apply(stacked, into_main, *ws)
        else:
            self.stack_fallbacks += 1
            w = torch.stack(ws)
        return w.transpose(1, 2).to(dtype)    # _grouped_mm computes x[offs_i-1:offs_i] @ w[i]

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        # the dispatcher's counts stay where they are (models/dispatch.py: on the device)
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0).to(torch.int32)
        h = torch._grouped_mm(x, self.stacked("linear_fc1", x.dtype), offs=offs)
        act = fused_swiglu_probs()(h, permuted_probs)
        out = torch._grouped_mm(act, self.stacked("linear_fc2", x.dtype), offs=offs)
        return out, None


def layer_specs(spec) -> list:
    """The per-layer specs of ``spec``: a layer spec (itself), or a block spec's ``layer_specs``."""
    layers = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    if layers is None:
        layers = getattr(spec, "layer_specs", None) or [spec]
    return list(layers)


def hook_spec(spec) -> int:
    """Use :class:`GroupedExperts` wherever ``spec`` (a layer spec or a block spec with
    ``layer_specs``) has megatron's ``SequentialMLP``; returns how many were replaced."""
    n = 0
    for layer in layer_specs(spec):
        mlp = getattr(layer.submodules, "mlp", None)
        experts = getattr(getattr(mlp, "submodules", None), "experts", None)
        if experts is not None and getattr(experts, "module", None) is SequentialMLP:
            experts.module = GroupedExperts
            n += 1
    return n
