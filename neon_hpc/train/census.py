"""A dispatch-level census of what a training step runs: aten ops, and the ops that would sync a device.

On CPU nothing waits for a device, so a host sync costs nothing there and a CPU run cannot see
one.  The census counts them anyway, by what they would do on CUDA (:func:`would_sync`, the one
home of this rule: the tests' budgets and ``tools/bench_train_gpu.py``'s ``syncs_per_step`` and
``moe_layer_syncs`` are counted by it):

- ops that return a host value or need one to size their output: ``_local_scalar_dense``
  (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``), ``nonzero``, ``masked_select``,
  ``unique``, ``bincount``, ``equal``, ``is_nonzero``, ``repeat_interleave`` without
  ``output_size``, boolean-mask indexing (``index`` / ``index_put_`` with a bool index:
  a ``nonzero`` inside the kernel);
- copies to the host: ``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.cpu`` (Python-level: on a
  CPU tensor they dispatch nothing, so they are counted by wrapping the methods while the
  census runs) and ``_to_copy`` / ``copy_`` whose destination is the CPU from another device.

Counts are kept per *scope*: ``"step"`` for everything, and one scope per module type given to
:func:`census` (forward pre/post hooks push and pop it, so the scope covers the module's
forward, not its backward), plus ``"optimizer"`` around ``optimizer.step``.  The tests
(``tests/unit/train/test_train_census.py``) assert budgets on these counts; a benchmark can report them.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops (overload packets) that need a device value on the host
SYNC_PACKETS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                "unique_dim", "unique_consecutive", "bincount", "equal", "is_nonzero", "allclose")
HOST_METHODS = ("tolist", "numpy", "cpu")
# views and metadata: no kernel, no memory traffic (not counted by :meth:`Census.per_tensor`)
VIEW_OPS = frozenset(("detach", "alias", "view", "_reshape_alias", "as_strided", "t", "transpose", "unsqueeze",
                      "squeeze", "expand", "select", "slice", "permute", "split", "split_with_sizes", "unbind",
                      "chunk", "narrow", "reshape", "_unsafe_view", "lift_fresh"))


@dataclass
class Census:
    """Per scope: ``ops`` (aten overload name -> count) and ``syncs`` (op or method -> count)."""
    ops: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    syncs: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def n_ops(self, scope: str = "step") -> int:
        return sum(self.ops[scope].values())

    def n_syncs(self, scope: str = "step") -> int:
        return sum(self.syncs[scope].values())

    def packets(self, scope: str = "step") -> Counter:
        """The scope's ops by overload packet (``"nonzero"`` for ``aten.nonzero.default``)."""
        return _by_packet(self.ops[scope])

    def per_tensor(self, n: int, scope: str = "step") -> dict[str, int]:
        """The scope's op packets issued at least ``n`` times (``n`` = the parameter tensors: a
        per-parameter loop), views aside; empty for ``n <= 1``."""
        return {k: v for k, v in self.packets(scope).items() if v >= n and k not in VIEW_OPS} if n > 1 else {}

    def summary(self) -> dict[str, tuple[int, int]]:
        """scope -> (aten ops, would-sync ops)."""
        return {s: (self.n_ops(s), self.n_syncs(s)) for s in sorted(set(self.ops) | set(self.syncs))}


def _by_packet(ops: Counter) -> Counter:
    out: Counter = Counter()
    for name, count in ops.items():
        out[name.split(".")[1]] += count          # str(OpOverload): "<namespace>.<packet>.<overload>"
    return out


def _is_bool_index(indices) -> bool:
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def would_sync(func, args, kwargs) -> bool:
    """Whether the aten op ``func`` called with ``args`` needs a device value on the host."""
    name = func.overloadpacket.__name__
    if name in SYNC_PACKETS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _is_bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name == "repeat_interleave":
        return func._overloadname != "self_int" and kwargs.get("output_size") is None   # tensor repeats
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst = args[0].device if name == "copy_" else kwargs.get("device")
        return torch.is_tensor(src) and src.device.type != "cpu" and dst is not None \
            and torch.device(dst).type == "cpu"
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, c: Census, scopes: list[str]) -> None:
        super().__init__()
        self.c, self.scopes = c, scopes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        sync = would_sync(func, args, kwargs)
        for s in {"step", self.scopes[-1]}:
            self.c.ops[s][name] += 1
            if sync:
                self.c.syncs[s][name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _host_methods(c: Census, scopes: list[str]):
    saved = {m: getattr(torch.Tensor, m) for m in HOST_METHODS}

    def wrap(m):
        orig = saved[m]

        def counted(self, *a, **kw):
            for s in {"step", scopes[-1]}:
                c.syncs[s][f"Tensor.{m}"] += 1
            return orig(self, *a, **kw)
        return counted

    for m in HOST_METHODS:
        setattr(torch.Tensor, m, wrap(m))
    try:
        yield
    finally:
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)


@contextlib.contextmanager
def census(modules: dict[str, list[torch.nn.Module]] | None = None, optimizer=None):
    """Count what runs inside the ``with`` block; yields the :class:`Census`.

    ``modules``: scope name -> the modules whose forward that scope covers; ``optimizer``:
    its ``step`` is the ``"optimizer"`` scope."""
    c, scopes, handles = Census(), ["step"], []
    for scope, mods in (modules or {}).items():
        for m in mods:
            handles.append(m.register_forward_pre_hook(lambda _m, _a, s=scope: scopes.append(s) and None))
            handles.append(m.register_forward_hook(lambda _m, _a, _o: scopes.pop() and None))
    own_step = optimizer is not None and "step" in vars(optimizer)
    if optimizer is not None:
        original_step = optimizer.step

        def step(*a, **kw):
            scopes.append("optimizer")
            try:
                return original_step(*a, **kw)
            finally:
                scopes.pop()
        optimizer.step = step
    try:
        with _host_methods(c, scopes), _Mode(c, scopes):
            yield c
    finally:
        for h in handles:
            h.remove()
        if own_step:
            optimizer.step = original_step
        elif optimizer is not None:
            del optimizer.step          # the instance attribute; the class's method again
