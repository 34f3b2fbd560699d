"""megatron-core's optimizers (FP32, and mixed precision: bf16 params, fp32 main params) without
apex or Transformer Engine, on CPU and on CUDA: multi-tensor kernels instead of per-tensor loops,
and the few CUDA literals rebound on a machine without CUDA.

Two patch groups, each chosen once by :func:`apply`:

**No apex, no TE** (chosen by what is installed, not by the device: megatron's optimizer module
fell back to ``megatron.core.utils.local_multi_tensor_applier``).  megatron-core 0.16.1's
fallbacks are per-tensor Python loops on the device: a ``torch.norm`` per parameter tensor
(each read back to the host), ``dst.copy_(src * scale)`` per tensor (two kernels) to clip, one
``copy_`` per tensor to move the fp32 main params into the bf16 model params.  Here, on CPU
and CUDA alike:

- ``clip_grads.get_grad_norm_fp32`` -> :func:`grad_norm_fp32`: ``torch._foreach_norm`` (one
  multi-tensor kernel per dtype/device), the p-th powers summed in float64 on the device,
  all-reduced (SUM; MAX for inf) over the same ``grad_stats_parallel_group``, and read back
  **once** (the float megatron's ``step`` returns for the metrics);
- ``clip_grads.clip_grad_by_total_norm_fp32`` -> :func:`clip_by_total_norm`: the same
  ``grad *= max_norm / (norm + 1e-6)`` when that factor is below 1, as one
  ``torch._foreach_mul_``.  The factor is a Python float (the norm is on the host already,
  from the one read-back above), i.e. a kernel argument: no transfer, no sync;
- ``optimizer._multi_tensor_copy_this_to_that`` (main -> model params after the step, model
  -> main at load) -> :func:`copy_this_to_that`: one ``torch._foreach_copy_`` (casts fp32 ->
  bf16 as ``copy_`` does).

**No CUDA** (megatron creates tensors with the literal ``device='cuda'``, not
``torch.cuda.current_device()``, which :mod:`neon_hpc.models.cpu_shim` already redirects, or
tests a tensor's CUDA type name):

- ``FP32Optimizer.__init__``: its constant loss scale ``_scale`` -> created on CPU;
- ``MixedPrecisionOptimizer.__init__``: its unit loss scale and overflow buffer (``device='cuda'``)
  -> the module's ``torch`` is :class:`~neon_hpc.models.cpu_shim.TorchOnCpu`;
- ``Float16OptimizerWithFloat16Params.__init__``: sorts parameters by ``param.type()`` against
  ``'torch.cuda.BFloat16Tensor'`` / ``'torch.cuda.FloatTensor'`` and refuses anything else ->
  during that constructor only, a CPU tensor's ``type()`` reads as its CUDA name (the same
  dtype; the fp32 main copies it makes are CPU tensors like their params);
- megatron's own ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` grads: on
  CPU the replacement above is required even where apex is installed.

The rest of the optimizer (param groups, ``ChainedOptimizer`` for expert params, main-grad copy,
fused Adam, ``sharded_state_dict`` for torch_dist checkpoints) is megatron-core's own.
:func:`apply` is idempotent; :func:`applied` says which groups are in effect.
"""

from __future__ import annotations

import contextlib
import math

import torch

from neon_hpc.models.cpu_shim import TorchOnCpu

_applied: dict[str, bool] = {}


def applied() -> dict[str, bool]:
    """``{"multi_tensor": ..., "cpu": ...}``: the patch groups in effect (empty before :func:`apply`)."""
    return dict(_applied)


def apply() -> dict[str, bool]:
    """Patch once; returns which groups are in effect (see the module docstring)."""
    if _applied:
        return dict(_applied)
    from megatron.core import utils as mutils  # deferred: heavy (megatron)
    from megatron.core.optimizer import optimizer as mopt  # deferred: heavy (megatron)

    no_apex = mopt.multi_tensor_applier is mutils.local_multi_tensor_applier
    cpu = not torch.cuda.is_available()
    if no_apex or cpu:
        mopt.get_grad_norm_fp32 = grad_norm_fp32
        mopt.clip_grad_by_total_norm_fp32 = clip_by_total_norm
    if no_apex:
        mopt._multi_tensor_copy_this_to_that = copy_this_to_that
    if cpu:
        _patch_cuda_literals(mopt)
    _applied.update(multi_tensor=no_apex or cpu, cpu=cpu)
    return dict(_applied)


def _patch_cuda_literals(mopt) -> None:
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


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """Global gradient norm: local sum of |g|^p (max for inf), reduced over the model-parallel
    group; one multi-tensor kernel per dtype and one read-back."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    # the grads are leaves outside autograd (and megatron calls this under no_grad): no ``detach`` each
    grads = list(grads_for_norm)
    norm_type = float(norm_type)
    dev = grads[0].device if grads else _device()
    # each tensor's norm in its own dtype (one fused pass each), combined in float64 on the device
    norms = torch._foreach_norm(grads, norm_type) if grads else []
    if norm_type == math.inf:
        total = (torch.stack(norms).double().max().reshape(1) if norms
                 else torch.zeros(1, dtype=torch.float64, device=dev))
        op = torch.distributed.ReduceOp.MAX
    else:
        total = torch.stack(norms).double().pow(norm_type).sum().reshape(1) if norms else \
            torch.zeros(1, dtype=torch.float64, device=dev)
        op = torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(total, op=op, group=grad_stats_parallel_group)
    value = float(total.item())                  # the one sync of the optimizer step
    return value if norm_type == math.inf else value ** (1.0 / norm_type)


@torch.no_grad()
def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """``grad *= max_norm / (total_norm + 1e-6)`` when below 1, one ``_foreach_mul_``."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    grads = [g for g in ((getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad)
                         for p in parameters) if g is not None]
    if grads:
        torch._foreach_mul_(grads, coeff)


@torch.no_grad()
def copy_this_to_that(this, that, overflow_buf=None) -> None:
    """``that[i].copy_(this[i])`` for every i, as one ``torch._foreach_copy_`` (dtype casts included)."""
    if this:
        torch._foreach_copy_(list(that), list(this))
