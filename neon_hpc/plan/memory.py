"""Trainer memory per GPU for a layout, and the layout a split of nodes gives.

Counted (bytes per parameter, megatron-core with bf16 weights and its distributed optimizer):

* weights 2 (bf16) and gradients 4 (fp32 main-grad buffer), on every GPU that holds the
  parameter's shard;
* optimizer state 12 (fp32 master copy, Adam m and v), sharded over the parameter's
  data-parallel replicas (the distributed optimizer).

Sharding: a dense parameter (attention, embeddings, dense and shared-expert MLPs, norms) is
split over ``tp x pp`` and replicated over ``world / (tp x pp)`` (DP x CP); a routed-expert
parameter is split over ``ep x pp`` (expert-TP 1) and replicated over ``world / (ep x pp)``.
Not counted: activations (they depend on micro-batch tokens and recomputation), NCCL and
allocator buffers; ``train_memory_fraction`` of the GPU is what the three states may use,
the rest is left for those.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BYTES_WEIGHT, BYTES_GRAD, BYTES_OPTIM = 2, 4, 12


@dataclass
class Layout:
    train_gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    bytes_per_gpu: float
    limit_bytes: float
    problem: str = ""          # why the split cannot be laid out or does not fit ("" = fits)

    @property
    def fits(self) -> bool:
        return not self.problem

    def describe(self) -> str:
        return f"tp{self.tp} pp{self.pp} cp{self.cp} ep{self.ep} dp{self.dp}: {self.bytes_per_gpu / 2**30:.0f} GiB/GPU"


def state_bytes_per_gpu(dense_params: float, expert_params: float, world: int, tp: int, pp: int, ep: int) -> float:
    """Weights + gradients + optimizer state on one trainer GPU (module docstring)."""
    d_share, d_repl = dense_params / (tp * pp), world / (tp * pp)
    e_share, e_repl = expert_params / (ep * pp), world / (ep * pp)
    per = BYTES_WEIGHT + BYTES_GRAD
    return d_share * (per + BYTES_OPTIM / d_repl) + e_share * (per + BYTES_OPTIM / e_repl)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, max(1, min(n, cap)) + 1) if n % d == 0)


def layout_search(train_gpus: int, tp: int, pp: int, cp: int, ep: int, dense_params: float, expert_params: float,
                  gpu_memory_bytes: float, fraction: float, num_experts: int = 0, num_layers: int = 0) -> Layout:
    """:func:`layout_for` with the config's ``pp``; when that does not divide ``train_gpus`` or
    does not fit, the smallest deeper pipeline that does (``pp' > pp`` dividing
    ``train_gpus / tp``, at least 2 layers per stage; ``train.pipeline_parallel`` is the
    user's to choose). Without ``num_layers`` only the config's ``pp``."""
    first = layout_for(train_gpus, tp, pp, cp, ep, dense_params, expert_params, gpu_memory_bytes, fraction,
                       num_experts)
    if first.fits or num_layers < 2 or train_gpus % tp:
        return first
    width = train_gpus // tp
    for pp2 in range(pp + 1, num_layers // 2 + 1):
        if width % pp2 == 0:
            lay = layout_for(train_gpus, tp, pp2, cp, ep, dense_params, expert_params, gpu_memory_bytes, fraction,
                             num_experts)
            if lay.fits:
                return lay
    return first


def layout_for(train_gpus: int, tp: int, pp: int, cp: int, ep: int, dense_params: float, expert_params: float,
               gpu_memory_bytes: float, fraction: float, num_experts: int = 0) -> Layout:
    """The layout ``train_gpus`` gives with the config's ``tp`` and ``pp``: CP the largest divisor
    of the model replica count up to the config's, EP the largest divisor of both
    ``train_gpus / pp`` and ``num_experts`` up to the config's, DP the rest; and whether it fits."""
    limit = gpu_memory_bytes * fraction
    if train_gpus < tp * pp or train_gpus % (tp * pp):
        return Layout(train_gpus, tp, pp, cp, ep, 0, math.inf, limit,
                      f"{train_gpus} GPUs are not a whole number of tp x pp = {tp * pp} model replicas")
    width = train_gpus // (tp * pp)               # DP x CP
    cp2 = _largest_divisor_at_most(width, cp)
    ep2 = _largest_divisor_at_most(math.gcd(train_gpus // pp, num_experts) if num_experts else train_gpus // pp, ep)
    dp = width // cp2
    b = state_bytes_per_gpu(dense_params, expert_params, train_gpus, tp, pp, ep2)
    problem = ""
    if b > limit:
        problem = (f"needs {b / 2**30:.0f} GiB/GPU of weights+grads+optimizer state "
                   f"(> {fraction:.0%} of {gpu_memory_bytes / 2**30:.0f} GiB)")
    return Layout(train_gpus, tp, pp, cp2, ep2, dp, b, limit, problem)
