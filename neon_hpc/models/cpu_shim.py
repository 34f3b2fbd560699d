"""Make megatron-core 0.16.1 run on a machine without CUDA (laptop, CI, the embedded default).

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths:
it asks for "the current CUDA device" to place tensors, keeps its RNG streams in CUDA
generators, builds the causal mask with ``device="cuda"``, refers to a Transformer Engine GEMM
by name, refuses torch norms under sequence parallelism, and moves MoE split sizes through a
side CUDA stream.  Each patch below replaces exactly one of those assumptions with its CPU
equivalent; nothing changes the arithmetic of a forward or backward pass.

:func:`apply` is idempotent and does nothing when CUDA is available, so the same code runs
unchanged on a GPU cluster.  It must run before a model is built; :mod:`neon_hpc.models.megatron`
calls it first thing.  A process that saves megatron checkpoints with gloo workers must keep
its entry point under ``if __name__ == "__main__":`` (the checkpoint writer forks/spawns).

The patch list, one line each (``PATCHES`` keeps the same names for tests and logs):

- ``jit_fuser``: megatron's ``jit_fuser`` (``torch.compile``) decorates its fusions with
  megatron's own no-op, so they run as their eager torch code.  ``megatron.core.jit`` binds
  ``torch.compile`` when it is imported, which costs every process an inductor import (~4 s of
  a loaded 2-core machine) and, where a decorated function runs (the DeepSeek-V3 router's
  ``_apply_expert_bias``, an integer counter update; the fusions proper are off in the model
  config), an inductor C++ compile per input shape (~20 s cold, ~2.5 s from its disk cache) for
  a 0.1 s step.  megatron.core is imported with ``torch.compile`` as the identity, which is
  restored after; a process that imported megatron before the shim keeps what it decorated.
- ``current_device``: ``torch.cuda.current_device()`` returns ``"cpu"``, so every
  ``device=torch.cuda.current_device()`` and ``.to(torch.cuda.current_device())`` lands on CPU.
- ``synchronize``: ``torch.cuda.synchronize()`` is a no-op (CPU ops are synchronous).
- ``rng_tracker``: megatron's RNG tracker saves/restores the CPU generator instead of a CUDA
  one, so ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work and
  stay reproducible per TP/EP rank.
- ``causal_mask``: ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` build
  their masks on CPU (they hard-code ``"cuda"``); patched where defined and
  where ``fused_softmax`` imported them.
- ``te_general_gemm``: ``moe_utils.te_general_gemm = None`` (without Transformer Engine the
  name is never defined and the router's gating GEMM raises NameError).
- ``torch_norm_sp``: ``WrappedTorchNorm`` accepts ``sequence_parallel`` (required by MoE when
  TP > 1) and marks its weights ``sequence_parallel`` so their grads are all-reduced over TP,
  as the fused norms do.
- ``streams``: ``torch.cuda.Stream/current_stream/stream/Event`` become one inert CPU stream
  and events whose waits return at once (the alltoall dispatcher's DtoH side stream).
- ``numpy_splits``: ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` returns numpy for CPU
  tensors too, as the alltoall dispatcher expects for its split sizes.
- ``pipeline_token_counter``: the pipeline schedules (``pipeline_parallel/schedules.py``) start
  their token counter with ``torch.zeros(..., device="cuda")``; the module's ``torch`` becomes
  a view of torch whose ``zeros`` maps ``"cuda"`` to ``"cpu"`` (everything else is torch itself).
- ``p2p_shapes``: with ``variable_seq_lengths`` the stages exchange each micro-batch's tensor
  shape before the tensor; megatron always does that with ``batch_isend_irecv``, which hangs
  on gloo.  The exchange goes through megatron's own ordered ``isend``/``irecv`` pairs
  (``_p2p_ops``, the path its tensors take with ``batch_p2p_comm=False``) and waits for them.
  The tensors themselves need no patch: the trainer sets ``batch_p2p_comm=False`` on CPU.
  The interleaved schedule (virtual pipeline stages) goes through the same ``_communicate``
  and the same token counter, so these two patches cover it too (tested at PP=2 x V=2).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch

PATCHES = ("jit_fuser", "current_device", "synchronize", "rng_tracker", "causal_mask", "te_general_gemm",
           "torch_norm_sp", "streams", "numpy_splits", "pipeline_token_counter", "p2p_shapes")

_lock = threading.Lock()
_applied: list[str] = []


def needed() -> bool:
    """True when there is no usable CUDA device (the shim only ever applies then)."""
    return not torch.cuda.is_available()


def applied() -> list[str]:
    """Names of the patches in effect in this process (empty on a GPU machine)."""
    return list(_applied)


def apply() -> list[str]:
    """Apply every patch once (thread-safe, idempotent); returns the names applied."""
    with _lock:
        if _applied or not needed():
            return list(_applied)
        for name in PATCHES:
            globals()[f"_patch_{name}"]()
            _applied.append(name)
        return list(_applied)


# --------------------------------------------------------------------------------------
# torch.compile, as megatron-core binds it

def _eager(model=None, **kwargs):
    """``torch.compile``'s two call forms (``compile(fn)``, ``compile(**options)(fn)``), compiling nothing."""
    return model if model is not None else (lambda fn: fn)


def _patch_jit_fuser() -> None:
    if "megatron.core.jit" not in sys.modules:
        compile_ = torch.compile
        torch.compile = _eager
        try:
            import megatron.core.jit  # noqa: F401  (imports megatron.core, whose fusions it decorates)
        finally:
            torch.compile = compile_
    from megatron.core import jit
    jit.disable_jit_fuser()         # what megatron imports later decorates with the no-op too


# --------------------------------------------------------------------------------------
# torch.cuda entry points

def _patch_current_device() -> None:
    # A string device works both as ``device=`` and as ``.to(...)`` argument.
    torch.cuda.current_device = lambda: "cpu"


def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


class _CpuStream:
    """Stands in for a CUDA stream: CPU work is already ordered, so every wait is immediate."""

    def wait_stream(self, other) -> None: pass
    def wait_event(self, event) -> None: pass
    def synchronize(self) -> None: pass
    def query(self) -> bool: return True
    def record_event(self, event=None): return event if event is not None else _CpuEvent()


class _CpuEvent:
    def __init__(self, *args, **kwargs) -> None: pass
    def record(self, stream=None) -> None: pass
    def wait(self, stream=None) -> None: pass
    def synchronize(self) -> None: pass
    def query(self) -> bool: return True


_STREAM = _CpuStream()


class _SameCpuStream(_CpuStream):
    # A class (not a lambda), so annotations like ``torch.cuda.Stream | None`` in other
    # libraries keep working; constructing it hands back the one shared stream.
    def __new__(cls, *args, **kwargs):
        return _STREAM


def _patch_streams() -> None:
    # One stream object everywhere: ``current_stream() != side_stream`` is then False and the
    # dispatcher never calls ``record_stream`` on a CPU tensor.
    torch.cuda.Stream = _SameCpuStream
    torch.cuda.current_stream = lambda device=None: _STREAM
    torch.cuda.default_stream = lambda device=None: _STREAM
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.Event = _CpuEvent


# --------------------------------------------------------------------------------------
# megatron-core internals

def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):  # mirrors CudaRNGStatesTracker.add on the CPU generator
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    # ``model_parallel_cuda_manual_seed`` seeds "the default CUDA generator" first; on CPU the
    # data-parallel seed belongs to the CPU generator.  torch.cuda.manual_seed is a lazy no-op
    # without CUDA, so route it to torch.manual_seed.
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)


def _patch_causal_mask() -> None:
    import functools

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=32)
    def causal(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    @functools.lru_cache(maxsize=32)
    def sliding(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    tutils.get_default_causal_mask = causal
    tutils.get_sliding_window_causal_mask = sliding
    fused_softmax.get_default_causal_mask = causal
    fused_softmax.get_sliding_window_causal_mask = sliding


def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm_sp() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("torch norms on CPU support neither zero_centered_gamma nor "
                             "memory_efficient_layer_norm; turn them off in the TransformerConfig")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization {config.normalization!r}: CPU shim supports LayerNorm and RMSNorm")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        # Same marking as megatron's fused norms: under SP each TP rank sees a slice of the
        # sequence, so the norm weight's grad must be summed over the TP group.
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    WrappedTorchNorm.__new__ = new


def _patch_numpy_splits() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move
    token_dispatcher.maybe_move_tensor_to_cpu = move


class _TorchWithCpuZeros:
    """``torch`` for one module, except that ``zeros(..., device="cuda")`` lands on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


def _patch_pipeline_token_counter() -> None:
    from megatron.core.pipeline_parallel import schedules
    schedules.torch = _TorchWithCpuZeros()


def _patch_p2p_shapes() -> None:
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        def shape_of(t):
            return None if t is None else torch.tensor(t.size(), dtype=torch.int64)

        recv_prev_t = torch.empty((3,), dtype=torch.int64) if recv_prev else None
        recv_next_t = torch.empty((3,), dtype=torch.int64) if recv_next else None
        reqs = p2p._p2p_ops(tensor_send_prev=shape_of(tensor_send_prev), tensor_recv_prev=recv_prev_t,
                            tensor_send_next=shape_of(tensor_send_next), tensor_recv_next=recv_next_t,
                            group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                            next_pipeline_rank=self.next_rank)
        for req in reqs.values():
            req.wait()
        return (recv_prev_t.tolist() if recv_prev_t is not None else [0, 0, 0],
                recv_next_t.tolist() if recv_next_t is not None else [0, 0, 0])

    p2p.P2PCommunicator._communicate_shapes = communicate_shapes
