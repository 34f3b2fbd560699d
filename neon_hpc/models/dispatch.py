"""Token dispatch without host syncs: permute by a device argsort of the routing map.

megatron-core's alltoall dispatcher at TP x EP = 1 costs four host syncs per MoE layer
(``masked_select`` to permute tokens and probabilities, the device-to-host copy of the
tokens per expert and its event sync, the pageable copy back to the device for the grouped
GEMM) and, with several local experts, an identity ``sort_chunks_by_idxs`` that copies every
routed token twice forward and twice backward (issue 40).  Here:

- :func:`permute`: one stable device argsort of the ``[E, T]`` routing map puts the routed
  (expert, token) slots first, expert-major and token-ascending (megatron's order exactly);
  tokens are gathered with ``index_select`` and the probabilities by flat index.  The output
  length is ``T * top_k``, a shape, not a device value: the router (and router replay, whose
  targets are an engine's top-k) selects exactly ``top_k`` distinct experts per token;
- tokens per expert (``routing_map.sum(0)``) stay on the device and go straight to the
  grouped GEMM's offsets (:mod:`.experts`);
- :func:`unpermute`: ``index_add_`` of the expert outputs into zeros of the input's shape;
- nothing between the two runs in identity order: no all-to-all, no chunk sort.

:class:`DeviceDispatcher` is the dispatcher for TP x EP = 1 (the expert-TP group and the EP
group of one rank); :class:`LocalPermuteAlltoAll` is megatron's alltoall dispatcher for larger
groups with its local permutation (before the all-to-all and after the reverse one) replaced by
the same two functions (the all-to-all itself needs its split sizes on the host: that sync
stays).  :class:`DispatchMoELayer` picks one of them in place of megatron's; :func:`hook_spec`
puts it in a layer spec, like :func:`neon_hpc.models.experts.hook_spec`.  Routing (and so
router replay) is untouched: the dispatcher only consumes the router's map.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoETokenDispatcher

from neon_hpc.models.experts import layer_specs


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, num_out: int):
    """``(permuted tokens [num_out, H], permuted probs [num_out], token index [num_out],
    tokens per expert [E])`` of ``tokens`` [T, H] routed by ``routing_map`` [T, E] (bool) with
    ``probs`` [T, E]; ``num_out`` is the number of routed slots (``T * top_k``).  No host sync."""
    n_tokens, n_experts = routing_map.shape
    slots = routing_map.t().reshape(-1).to(torch.int8)                       # [E * T], expert-major
    order = torch.argsort(slots, descending=True, stable=True).narrow(0, 0, num_out)   # routed slots first
    token = torch.remainder(order, n_tokens)
    expert = torch.div(order, n_tokens, rounding_mode="floor")
    permuted_probs = probs.reshape(-1).index_select(0, token * n_experts + expert)
    return tokens.index_select(0, token), permuted_probs, token, routing_map.sum(dim=0)


def unpermute(permuted: torch.Tensor, token: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The sum over each token's routed slots, ``[T, H]`` in ``permuted``'s dtype."""
    return torch.zeros(shape, dtype=permuted.dtype, device=permuted.device).index_add_(0, token, permuted)


def _check(config) -> None:
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity \
            or config.moe_router_padding_for_quantization or config.moe_shared_expert_overlap \
            or config.moe_permute_fusion or config.moe_latent_size:
        raise ValueError("the device dispatcher (neon_hpc.models.dispatch) runs dropless routing without "
                         "capacity, padding, fused permutation, latent projections or shared-expert overlap; "
                         "build the model with dispatch='megatron' for those")


class DeviceDispatcher(MoETokenDispatcher):
    """The MoE token dispatcher for TP x EP = 1: a device permutation, nothing else (module docstring)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        _check(config)
        if self.tp_size * self.ep_size != 1:
            raise ValueError(f"DeviceDispatcher serves expert TP x EP = 1, got {self.tp_size} x {self.ep_size}; "
                             "larger groups use LocalPermuteAlltoAll")
        self.num_local_experts, self.local_expert_indices = num_local_experts, local_expert_indices
        self.topk = config.moe_router_topk
        self.token = self.tokens_per_expert = self.hidden_shape = self.restore_shape = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        flat = hidden_states.view(-1, self.hidden_shape[-1])
        self.restore_shape = flat.shape
        x, p, self.token, self.tokens_per_expert = permute(flat, routing_map, probs, routing_map.size(0) * self.topk)
        return x, p

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        counts, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, counts, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor):
        out = unpermute(hidden_states, self.token, self.restore_shape)
        return out.view(self.hidden_shape)


class LocalPermuteAlltoAll(MoEAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher with the local permutation of :func:`permute` / :func:`unpermute`
    (the split sizes of the all-to-all still come to the host: that is the all-to-all's own sync)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        _check(config)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape, self.probs, self.routing_map = hidden_states.shape, probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        x, p, self.reversed_local_input_permutation_mapping, _ = permute(
            hidden_states, routing_map, probs, routing_map.size(0) * self.config.moe_router_topk)
        return x, p

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor):
        out = unpermute(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
                        self.hidden_shape_before_permute)
        return out.view(self.hidden_shape)


class DispatchMoELayer(MoELayer):
    """megatron's ``MoELayer`` with :class:`DeviceDispatcher` (expert TP x EP = 1) or
    :class:`LocalPermuteAlltoAll` in place of its alltoall dispatcher; same parameters."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError(f"DispatchMoELayer replaces the alltoall dispatcher, got "
                             f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}")
        pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        old = self.token_dispatcher
        cls = DeviceDispatcher if old.tp_size * old.ep_size == 1 else LocalPermuteAlltoAll
        self.token_dispatcher = cls(self.num_local_experts, self.local_expert_indices, config=self.config,
                                    pg_collection=pg_collection)


IMPLS = ("device", "megatron")


def hook_spec(spec) -> int:
    """Use :class:`DispatchMoELayer` wherever ``spec`` (a layer spec or a block spec with
    ``layer_specs``) has megatron's ``MoELayer``; returns how many were replaced."""
    n = 0
    for layer in layer_specs(spec):
        mlp = getattr(layer.submodules, "mlp", None)
        if mlp is not None and getattr(mlp, "module", None) is MoELayer:
            mlp.module = DispatchMoELayer
            n += 1
    return n


class _UnlistedMoELayer(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


@contextlib.contextmanager
def quiet_layer_build():
    """While a hooked spec builds: megatron's ``TransformerLayer`` warns "Unknown MLP type" for
    an MLP class it does not list and passes it no ``pg_collection``; :class:`DispatchMoELayer`
    then takes megatron's default process groups, which is what the layer would have passed
    (the model is built without a collection of its own).  Drops that one record, nothing else."""
    log = logging.getLogger("megatron.core.transformer.transformer_layer")
    f = _UnlistedMoELayer()
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)
