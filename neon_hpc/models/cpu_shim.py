"""Make megatron-core 0.16.1 run where it assumes a GPU or Transformer Engine that is not there.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths (it
asks for "the current CUDA device" to place tensors, keeps its RNG streams in CUDA generators,
builds the causal mask with ``device="cuda"``, moves MoE split sizes through a side CUDA
stream), and Transformer Engine in others (it refers to TE's GEMM by name in the router,
refuses torch norms under sequence parallelism).  The two are independent: a cluster user's
CUDA install often has no TE, and a laptop has neither.  Each patch below replaces exactly one
assumption; nothing changes the arithmetic of a forward or backward pass.

Which patches apply is a pure function of what this process has (:func:`patches_for`): the
``NO_TE`` group whenever ``transformer_engine`` does not import (CPU *or* CUDA), the
``NO_CUDA`` group only without a usable CUDA device.  :func:`apply` applies those once
(idempotent); it must run before a model is built (:mod:`neon_hpc.models.megatron` calls it
first thing).  :func:`kernels` says which optional kernels were found, for the start-up log.
A process that saves megatron checkpoints with gloo workers must keep its entry point under
``if __name__ == "__main__":`` (the checkpoint writer forks/spawns).

Without Transformer Engine (``NO_TE``):

- ``te_general_gemm``: ``moe_utils.te_general_gemm = None`` (the name is only defined when TE
  imports, and the router's gating GEMM raises NameError without it; with None megatron
  takes its torch matmul).
- ``torch_norm_sp``: ``WrappedTorchNorm`` accepts ``sequence_parallel`` (required by MoE when
  TP > 1) and marks its weights ``sequence_parallel`` so their grads are all-reduced over TP,
  as the fused norms do.
- ``recompute_fp8``: ``CheckpointWithoutOutput()`` (the output-discarding recompute of the norms
  under ``train.recompute: selective``) sets ``self.fp8 = fp8 is not None``, True for its
  default ``fp8=False``, and then asks TE's ``FP8GlobalStateManager`` (undefined without TE:
  NameError).  Without TE there is no fp8: it is set False.

Without CUDA (``NO_CUDA``):

- ``jit_fuser``: megatron's ``jit_fuser`` (``torch.compile``) decorates its fusions with
  megatron's own no-op, so they run as their eager torch code.  ``megatron.core.jit`` binds
  ``torch.compile`` when it is imported, which costs every process an inductor import (~4 s of
  a loaded 2-core machine) and, where a decorated function runs (the DeepSeek-V3 router's
  ``_apply_expert_bias``, an integer counter update; the fusions proper are off in the model
  config), an inductor C++ compile per input shape (~20 s cold, ~2.5 s from its disk cache) for
  a 0.1 s step.  megatron.core is imported with ``torch.compile`` as the identity, which is
  restored after; a process that imported megatron before the shim keeps what it decorated.
  On CUDA megatron compiles them as it means to (inductor and triton ship with CUDA torch).
- ``current_device``: ``torch.cuda.current_device()`` returns ``"cpu"``, so every
  ``device=torch.cuda.current_device()`` and ``.to(torch.cuda.current_device())`` lands on CPU.
- ``synchronize``: ``torch.cuda.synchronize()`` is a no-op (CPU ops are synchronous).
- ``rng_tracker``: megatron's RNG tracker saves/restores the CPU generator instead of a CUDA
  one, so ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work and
  stay reproducible per TP/EP rank.
- ``causal_mask``: ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` build
  their masks on CPU (they hard-code ``"cuda"``); patched where defined and
  where ``fused_softmax`` imported them.
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
import functools
import importlib.util
import sys
import threading

import torch

NO_TE = ("te_general_gemm", "torch_norm_sp", "recompute_fp8")
NO_CUDA = ("jit_fuser", "current_device", "synchronize", "rng_tracker", "causal_mask", "streams",
           "numpy_splits", "pipeline_token_counter", "p2p_shapes")
# application order: jit_fuser first (it imports megatron.core with torch.compile disabled)
PATCHES = ("jit_fuser", "current_device", "synchronize", "rng_tracker", "causal_mask", "te_general_gemm",
           "torch_norm_sp", "recompute_fp8", "streams", "numpy_splits", "pipeline_token_counter", "p2p_shapes")

_lock = threading.Lock()
_applied: list[str] = []
_done = False


def has_cuda() -> bool:
    """A usable CUDA device (the device side of :func:`patches_for`)."""
    return torch.cuda.is_available()


def has_te() -> bool:
    """Transformer Engine's PyTorch module imports (the library side of :func:`patches_for`)."""
    return importlib.util.find_spec("transformer_engine") is not None and _te_imports()


def _te_imports() -> bool:
    try:   # by name: an optional package, not a dependency (tests/structure/test_packaging_deps.py reads imports)
        importlib.import_module("transformer_engine.pytorch")
    except Exception:   # a broken TE install is "no TE": megatron's own import guard says the same
        return False
    return True


def patches_for(cuda: bool, te: bool) -> list[str]:
    """The patches a process with (``cuda``, ``te``) needs, in application order."""
    wanted = set(() if te else NO_TE) | set(() if cuda else NO_CUDA)
    return [p for p in PATCHES if p in wanted]


def needed() -> bool:
    """True when this process needs any patch."""
    return bool(patches_for(has_cuda(), has_te()))


def applied() -> list[str]:
    """Names of the patches in effect in this process."""
    return list(_applied)


def apply(cuda: bool | None = None, te: bool | None = None) -> list[str]:
    """Apply this process's :func:`patches_for` once (thread-safe, idempotent); returns the names applied.

    ``cuda`` / ``te`` override what is detected (tests simulate a CUDA machine without TE);
    only the first call decides."""
    global _done
    with _lock:
        if _done:
            return list(_applied)
        names = patches_for(has_cuda() if cuda is None else cuda, has_te() if te is None else te)
        for name in names:
            globals()[f"_patch_{name}"]()
            _applied.append(name)
        _done = True
        return list(_applied)


def _grouped_gemm(cuda: bool) -> str:
    if not hasattr(torch, "_grouped_mm"):
        return "none (sequential experts)"
    if cuda and torch.cuda.get_device_capability() < (8, 0):
        return "none on this GPU (sequential experts)"
    return "torch._grouped_mm" + (" (bf16 only; fp32 runs sequential experts)" if cuda else "")


def kernels() -> dict[str, object]:
    """The optional kernels this process found, for the trainer's start-up log (no side effects
    beyond imports of what is installed)."""
    cuda = has_cuda()
    sdpa = {"flash": bool(cuda and torch.backends.cuda.flash_sdp_enabled()),
            "mem_efficient": bool(cuda and torch.backends.cuda.mem_efficient_sdp_enabled()),
            "cpu_flash": not cuda}
    return {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "transformer_engine": has_te(),
            "flash_attn": importlib.util.find_spec("flash_attn") is not None,
            "sdpa": sdpa,
            "grouped_gemm": _grouped_gemm(cuda),
            "patches": applied()}


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
            # deferred: heavy (megatron)
            import megatron.core.jit  # noqa: F401  (imports megatron.core, whose fusions it decorates)
        finally:
            torch.compile = compile_
    from megatron.core import jit  # deferred: heavy (megatron)
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
    from megatron.core.tensor_parallel import random as mrandom  # deferred: heavy (megatron)

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
    # deferred: heavy (megatron)
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
    from megatron.core.transformer.moe import moe_utils  # deferred: heavy (megatron)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm_sp() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # deferred: heavy (megatron)

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


def _patch_recompute_fp8() -> None:
    from megatron.core.tensor_parallel import random as mrandom  # deferred: heavy (megatron)
    original = mrandom.CheckpointWithoutOutput.__init__

    def init(self, fp8=False):
        original(self, fp8=fp8)
        self.fp8 = False              # no TE, no fp8 (megatron 0.16.1 reads `fp8 is not None`)

    mrandom.CheckpointWithoutOutput.__init__ = init


def _patch_numpy_splits() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher  # deferred: heavy (megatron)

    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _on_cpu(device):
    return "cpu" if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda") else device


class TorchOnCpu:
    """``torch`` for one module, except that ``zeros`` / ``tensor`` with ``device="cuda"`` land on
    CPU (bound as a megatron module's ``torch`` where it hard-codes the literal)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_on_cpu(device), **kwargs)


def _patch_pipeline_token_counter() -> None:
    from megatron.core.pipeline_parallel import schedules  # deferred: heavy (megatron)
    schedules.torch = TorchOnCpu()


def _patch_p2p_shapes() -> None:
    from megatron.core.pipeline_parallel import p2p_communication as p2p  # deferred: heavy (megatron)

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
