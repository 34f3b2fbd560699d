"""Let megatron-core's optimizers (FP32, and mixed precision: bf16 params, fp32 main params) run
without CUDA (the trainer's addition to the CPU shim).

``megatron.core.optimizer`` (0.16.1) is plain torch apart from places that create tensors with
the literal ``device='cuda'`` (not ``torch.cuda.current_device()``, which
:mod:`neon_hpc.models.cpu_shim` already redirects) or test a tensor's CUDA type name:

- ``FP32Optimizer.__init__``: its constant loss scale ``_scale`` -> created on CPU.
- ``clip_grads.get_grad_norm_fp32``: the L2 norm accumulator -> the same sum of squares,
  all-reduced (SUM) over the same ``grad_stats_parallel_group``, on CPU.
- ``clip_grads.clip_grad_by_total_norm_fp32``: asserts ``torch.cuda.FloatTensor`` grads and
  scales with a CUDA overflow buffer -> the same ``grad *= max_norm / (norm + 1e-6)`` when
  that factor is below 1.
- ``MixedPrecisionOptimizer.__init__``: its unit loss scale (bf16 has no grad scaler) is made
  with ``device='cuda'`` -> the module's ``torch`` is :class:`~neon_hpc.models.cpu_shim.TorchOnCpu`.
- ``Float16OptimizerWithFloat16Params.__init__``: sorts parameters by ``param.type()`` against
  ``'torch.cuda.BFloat16Tensor'`` / ``'torch.cuda.FloatTensor'`` and refuses anything else ->
  during that constructor only, a CPU tensor's ``type()`` reads as its CUDA name (the same
  dtype; the fp32 main copies it makes are CPU tensors like their params).

The replacements are bound where ``megatron.core.optimizer.optimizer`` looks them up, so the
rest of the optimizer (param groups, ``ChainedOptimizer`` for expert params, main-grad copy,
``sharded_state_dict`` for torch_dist checkpoints) is megatron-core's own.  :func:`apply` is
idempotent and does nothing when CUDA is available.  It could move into ``cpu_shim``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from neon_hpc.models.cpu_shim import TorchOnCpu

_applied = False


def apply() -> bool:
    """Patch once (no-op with CUDA); returns whether the CPU versions are in effect."""
    global _applied
    if _applied or torch.cuda.is_available():
        return _applied
    from megatron.core.optimizer import optimizer as mopt  # deferred: heavy (megatron)

    original_init = mopt.FP32Optimizer.__init__

    def fp32_init(self, optimizer, config, init_state_fn):
        # MegatronOptimizer.__init__ is device-free; only the scale constant is not.
        mopt.MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.tensor([1.0], dtype=torch.float)
        self.is_stub_optimizer = optimizer is None

    fp32_init.__wrapped__ = original_init
    mopt.FP32Optimizer.__init__ = fp32_init
    mopt.torch = TorchOnCpu()
    f16_init = mopt.Float16OptimizerWithFloat16Params.__init__

    def float16_init(self, *args, **kwargs):
        with _cuda_type_names():
            f16_init(self, *args, **kwargs)

    float16_init.__wrapped__ = f16_init
    mopt.Float16OptimizerWithFloat16Params.__init__ = float16_init
    mopt.get_grad_norm_fp32 = grad_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = clip_by_total_norm
    _applied = True
    return True


@contextlib.contextmanager
def _cuda_type_names():
    """``Tensor.type()`` (no arguments) of a CPU tensor reads ``torch.cuda.<Kind>Tensor``."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """Global gradient norm: local sum of |g|^p, summed over the model-parallel group."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        local = max((g.detach().abs().max().float() for g in grads_for_norm), default=torch.tensor(0.0))
        total = torch.tensor([float(local)])
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=grad_stats_parallel_group)
        return float(total[0])
    # each tensor's norm in its own dtype (one fused pass each), their p-th powers summed in float64
    norms = torch._foreach_norm([g.detach() for g in grads_for_norm], norm_type) if grads_for_norm else []
    total = torch.zeros(1, dtype=torch.float64)
    if norms:
        total += torch.stack(norms).double().pow(norm_type).sum()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return float(total[0]) ** (1.0 / norm_type)


@torch.no_grad()
def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            g.mul_(coeff)
