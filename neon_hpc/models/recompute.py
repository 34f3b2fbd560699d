"""Activation recomputation that replays what the forward pass saw.

megatron-core recomputes a checkpointed region (a whole layer under ``train.recompute: full``,
the MoE layer under ``selective``) in the backward pass by calling its forward again with the
saved inputs and RNG state (``tensor_parallel.random.CheckpointFunction``).  Two things the
trainer's forward depends on are not inputs of that region:

- the **piece map** of the micro-batch (:mod:`neon_hpc.models.cp_attention`): which
  document each row belongs to, its true position, the K/V exchange.  It is set around the
  forward only; the backward (later, outside it: 1F1B runs other forwards in between) would
  recompute attention without it, as one dense causal sequence;
- the **router replay** targets: the trainer clears them after each micro-batch's forward, so a
  recomputed router would choose its own top-k and the gradient would flow through experts
  the engine never used.

:func:`install` wraps ``CheckpointFunction`` once: its forward captures both (the active piece map,
and every ``RouterReplay`` instance's action and target indices) on the autograd context, and
its backward runs megatron's under exactly that state, then puts back what was there.  The
recomputed forward is then the forward that ran, bit for bit in fp32 (tested).
"""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_installed = False


def _capture():
    from megatron.core.transformer.moe.router_replay import RouterReplay  # deferred: heavy (megatron)

    # deferred: heavy (neon_hpc.models.cp_attention: torch, megatron)
    from neon_hpc.models.cp_attention import active_piece_map
    routers = [(r, r.router_replay_action, r.target_topk_idx) for r in RouterReplay.global_router_replay_instances]
    return active_piece_map(), routers


@contextlib.contextmanager
def _replaying(state):
    # deferred: heavy (neon_hpc.models.cp_attention: torch, megatron)
    from neon_hpc.models.cp_attention import piece_map
    pmap, routers = state
    before = [(r, r.router_replay_action, r.target_topk_idx) for r, _, _ in routers]
    for r, action, target in routers:
        r.router_replay_action, r.target_topk_idx = action, target
    try:
        with piece_map(pmap):
            yield
    finally:
        for r, action, target in before:
            r.router_replay_action, r.target_topk_idx = action, target


def install() -> bool:
    """Wrap megatron's ``CheckpointFunction`` (idempotent); returns True once installed."""
    global _installed
    with _lock:
        if _installed:
            return True
        from megatron.core.tensor_parallel import random as mrandom  # deferred: heavy (megatron)
        fn = mrandom.CheckpointFunction
        forward, backward = fn.forward, fn.backward

        def fwd(ctx, run_function, distribute_saved_activations, *args):
            ctx.neon_state = _capture()
            return forward(ctx, run_function, distribute_saved_activations, *args)

        def bwd(ctx, *grads):
            with _replaying(ctx.neon_state):
                return backward(ctx, *grads)

        fn.forward, fn.backward = staticmethod(fwd), staticmethod(bwd)
        _installed = True
        return True
