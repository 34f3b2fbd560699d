"""Trainer memory per GPU for a layout, and the layout a split of nodes gives.

Counted (bytes per parameter, megatron-core with bf16 weights and its distributed optimizer):

* weights 2 (bf16) and gradients 4 (fp32 main-grad buffer), on every GPU that holds the
  parameter's shard;
* optimizer state 12 (fp32 master copy, Adam m and v), sharded over the parameter's
  data-parallel replicas (the distributed optimizer).

Sharding: a dense parameter (attention, embeddings, dense and shared-expert MLPs, norms) is
split over ``tp x pp`` and replicated over ``world / (tp x pp)`` (DP x CP); a routed-expert
parameter is split over ``ep x pp`` (expert-TP 1) and replicated over ``world / (ep x pp)``.

Activations (:class:`ActivationTerm`), for a micro-batch of ``T = balance.tokens_per_microbatch``
tokens (one document of T tokens, the worst case), on the first pipeline stage, which under
1F1B holds ``pp`` micro-batches in flight of ``ceil(L / pp)`` layers each (about L layers' worth):

* per layer ``per_hidden x hidden x T / (cp x tp)`` bytes (a CP rank holds ``T / cp`` tokens,
  sequence parallelism splits them over TP) plus ``per_head x heads / tp x (T / cp) x T`` for
  attention scores a kernel materialises (a CP rank's queries against the whole prefix);
* outside the layers ``per_vocab x vocab / tp x T / cp`` (logits and the cross-entropy's
  buffers: the output layer is split by vocabulary over TP);
* ``train.recompute``: ``selective`` (the trainer recomputes the MoE layer and the norms,
  ``train/backend.recompute_overrides``) drops the scores term and otherwise counts the layer
  as without recompute (an upper bound for the formula; a measurement taken with
  ``selective`` is the real figure); ``full`` keeps only each layer's input (``element_bytes x hidden`` per token and
  layer) plus one layer's working set (the layer re-run in the backward).

The coefficients are **measured** when ``plan.activation_file`` names a cost file with a
``memory`` block (``neon-hpc costfit --out``: the trainer's own step,
``neon_hpc/balance/memory.py``), else the formula :data:`FORMULA`: per layer 34 bytes per
token per hidden unit in bf16 (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", ``sbh(34 + 5as/h)`` per layer, the ``5as/h`` score term left
out because fused attention does not store the scores), 10 bytes per token per vocabulary
entry (bf16 logits 2, the cross-entropy's fp32 logits and softmax 4 + 4).  Not counted: the
interleaved schedule's extra micro-batches in flight (``virtual_pipeline_stages``), MoE
dispatch buffers beyond what a measurement sees, NCCL and allocator buffers;
``train_memory_fraction`` of the GPU is what states and activations may use, the rest is
left for those.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIM = 2, 4, 12
# the activation formula without a measurement (module docstring): bf16 elements
FORMULA = {"per_hidden": 34.0, "per_head": 0.0, "per_vocab": 10.0, "element_bytes": 2}


@dataclass(frozen=True)
class ActivationTerm:
    """Activation bytes per GPU of one layout (module docstring), from the model's shape, the
    micro-batch token cap, the recomputation and the per-unit coefficients."""

    hidden: int
    heads: int
    vocab: int
    num_layers: int
    token_cap: int
    recompute: str = "none"           # train.recompute
    per_hidden: float = FORMULA["per_hidden"]
    per_head: float = FORMULA["per_head"]
    per_vocab: float = FORMULA["per_vocab"]
    element_bytes: int = FORMULA["element_bytes"]

    def layer_bytes(self, tp: int, cp: int) -> float:
        """One layer's activations of one micro-batch on one GPU (scores dropped under recompute)."""
        T = float(self.token_cap)
        linear = self.per_hidden * self.hidden * T / (cp * tp)
        scores = 0.0 if self.recompute != "none" else self.per_head * self.heads / tp * (T / cp) * T
        return linear + scores

    def bytes_per_gpu(self, tp: int, pp: int, cp: int) -> float:
        T = float(self.token_cap)
        layers_in_flight = pp * math.ceil(self.num_layers / pp)         # 1F1B: pp micro-batches on stage 0
        if self.recompute == "full":
            stored = layers_in_flight * self.element_bytes * self.hidden * T / (cp * tp) + self.layer_bytes(tp, cp)
        else:
            stored = layers_in_flight * self.layer_bytes(tp, cp)
        return stored + self.per_vocab * self.vocab / tp * T / cp


@dataclass
class CandidateLayout:
    """One parallel split the planner considers for the trainer (TP/PP/CP/EP/DP) and its memory per GPU."""

    train_gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    bytes_per_gpu: float       # weights + grads + optimizer state + activations
    limit_bytes: float
    problem: str = ""          # why the split cannot be laid out or does not fit ("" = fits)
    activation_bytes: float = 0.0   # of bytes_per_gpu (0 without an ActivationTerm)

    @property
    def fits(self) -> bool:
        return not self.problem

    def describe(self) -> str:
        act = f" ({self.activation_bytes / 2**30:.0f} activations)" if self.activation_bytes else ""
        return (f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} dp{self.dp}: "
                f"{self.bytes_per_gpu / 2**30:.0f} GiB/GPU{act}")


def state_bytes_per_gpu(dense_params: float, expert_params: float, world: int, tp: int, pp: int, ep: int) -> float:
    """Weights + gradients + optimizer state on one trainer GPU (module docstring)."""
    d_share, d_repl = dense_params / (tp * pp), world / (tp * pp)
    e_share, e_repl = expert_params / (ep * pp), world / (ep * pp)
    per = BYTES_WEIGHT + BYTES_GRAD
    return d_share * (per + BYTES_OPTIM / d_repl) + e_share * (per + BYTES_OPTIM / e_repl)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


def layout_search(train_gpus: int, tp: int, pp: int, cp: int, ep: int, dense_params: float, expert_params: float,
                  gpu_memory_bytes: float, fraction: float, num_experts: int = 0, num_layers: int = 0,
                  activations: ActivationTerm | None = None) -> CandidateLayout:
    """:func:`layout_for` with the config's ``pp``; when that does not divide ``train_gpus`` or
    does not fit, the smallest deeper pipeline that does (``pp' > pp`` dividing
    ``train_gpus / tp``, at least 2 layers per stage; ``train.pipeline_parallel`` is the
    user's to choose). Without ``num_layers`` only the config's ``pp``."""
    first = layout_for(train_gpus, tp, pp, cp, ep, dense_params, expert_params, gpu_memory_bytes, fraction,
                       num_experts, activations)
    if first.fits or num_layers < 2 or train_gpus % tp:
        return first
    width = train_gpus // tp
    for pp2 in range(pp + 1, num_layers // 2 + 1):
        if width % pp2 == 0:
            lay = layout_for(train_gpus, tp, pp2, cp, ep, dense_params, expert_params, gpu_memory_bytes, fraction,
                             num_experts, activations)
            if lay.fits:
                return lay
    return first


def layout_for(train_gpus: int, tp: int, pp: int, cp: int, ep: int, dense_params: float, expert_params: float,
               gpu_memory_bytes: float, fraction: float, num_experts: int = 0,
               activations: ActivationTerm | None = None) -> CandidateLayout:
    """The layout ``train_gpus`` gives with the config's ``tp`` and ``pp``: CP the largest divisor
    of the model replica count up to the config's, EP the largest divisor of both
    ``train_gpus / pp`` and ``num_experts`` up to the config's, DP the rest; and whether its
    states plus ``activations`` (none counted without) fit."""
    limit = gpu_memory_bytes * fraction
    if train_gpus < tp * pp or train_gpus % (tp * pp):
        return CandidateLayout(train_gpus, tp, pp, cp, ep, 0, math.inf, limit,
                      f"{train_gpus} GPUs are not a whole number of tp x pp = {tp * pp} model replicas")
    width = train_gpus // (tp * pp)               # DP x CP
    cp2 = _largest_divisor_at_most(width, cp)
    ep2 = _largest_divisor_at_most(math.gcd(train_gpus // pp, num_experts) if num_experts else train_gpus // pp, ep)
    dp = width // cp2
    states = state_bytes_per_gpu(dense_params, expert_params, train_gpus, tp, pp, ep2)
    act = activations.bytes_per_gpu(tp, pp, cp2) if activations is not None else 0.0
    b = states + act
    problem = ""
    if b > limit:
        what = f"{states / 2**30:.0f} GiB weights+grads+optimizer state"
        if activations is not None:
            what += f" + {act / 2**30:.0f} GiB activations (recompute {activations.recompute})"
        problem = f"needs {b / 2**30:.0f} GiB/GPU ({what}; > {fraction:.0%} of {gpu_memory_bytes / 2**30:.0f} GiB)"
    return CandidateLayout(train_gpus, tp, pp, cp2, ep2, dp, b, limit, problem, act)
