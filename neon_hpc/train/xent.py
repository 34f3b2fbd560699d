"""Cross-entropy over sequence chunks: the output layer and the vocab-parallel cross-entropy
fused, so a long document's logits are never held whole (neither in bf16 nor in fp32).

megatron's GPTModel computes ``logits = output_layer(hidden)`` ``[S, B, V/tp]`` and then
``vocab_parallel_cross_entropy``, which makes an fp32 copy of all of them and keeps the fp32
softmax for backward: 2 x 4 x S x V bytes (64k tokens x 151k vocab: 79 GB).  Here
:class:`ChunkedVocabParallelCE` takes the hidden states and the output weight, and per chunk of
``rows`` positions computes that chunk's logits (in the model's dtype, as the output layer
would), their fp32 log-sum-exp and the label's logit.  It keeps the fp32 softmax of the first
chunks, as megatron keeps all of it, up to ``SAVE_BYTES`` (2 GiB) in all, and for the chunks
beyond only the fp32 log-sum-exp ``[S, B]``: backward recomputes those chunks' logits (one
more output-layer matmul for those positions) and turns each chunk into
``(softmax - onehot) * grad`` for that chunk alone.  Short sequences therefore run exactly
megatron's arithmetic at megatron's cost; a long one's memory stops growing with its length
past the budget, for the price of the recompute.

Numerics: per position the same operations as megatron's ``_VocabParallelCrossEntropy``
(fp32 logits minus their max over the whole vocabulary, ``exp``, sum, ``log``; max and sum
all-reduced over TP, the label's logit from the rank holding it), so the loss is the same to
float rounding; the gradient is the same formula, cast to the logits' dtype before the two
matmuls exactly as autograd casts megatron's fp32 gradient back through ``.float()``.
The label mask is a ``torch.where`` (megatron's boolean index_put would sync a device).

Tensor parallelism: the input goes through the same region function the output layer applies
(``copy_to_tensor_model_parallel_region``, or the sequence-parallel all-gather), so the input
gradient is all-reduced (reduce-scattered) over TP as the output layer's is.

Installed per model by :func:`install` (the last pipeline stage's GPTModel): the output layer
returns a :class:`DeferredLogits` instead of logits while :func:`deferred` is active (the
trainer's forward with labels), and ``compute_language_model_loss`` runs the chunked CE on it.
Outside that context (no labels: callers that want logits) the model is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

# the fp32 logits of one chunk are at most this many bytes (and at least MIN_ROWS positions)
CHUNK_BYTES = 1 << 30
MIN_ROWS = 256
# the fp32 softmax kept for backward, over all chunks, at most this many bytes (the rest recomputed)
SAVE_BYTES = 2 << 30

_state = threading.local()


def chunk_rows(vocab_local: int, batch: int = 1, chunk_bytes: int | None = None) -> int:
    """Sequence positions per chunk so one chunk's fp32 logits fit in ``chunk_bytes``."""
    per_row = 4 * vocab_local * max(batch, 1)
    return max(MIN_ROWS, int((CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // per_row))


def _chunks(s: int, rows: int):
    return [(a, min(a + rows, s)) for a in range(0, s, rows)]


class ChunkedVocabParallelCE(torch.autograd.Function):
    """``loss[s, b] = logsumexp(hidden[s, b] @ W.T) - (hidden[s, b] @ W.T)[label]`` over the TP
    vocabulary shards, in chunks of ``rows`` sequence positions.

    A chunk's fp32 ``exp(logits - max)`` is kept for backward (as megatron keeps it) while the
    kept chunks stay within ``save_bytes``; later chunks keep nothing and recompute their
    logits in backward (one more output-layer matmul for those positions)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, rows, vocab_start, tp_group, save_bytes=None):
        s = hidden.shape[0]
        vocab_local = weight.shape[0]
        budget = SAVE_BYTES if save_bytes is None else save_bytes
        loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        tp = tp_group is not None and dist.get_world_size(tp_group) > 1
        kept, kept_bytes = [], 0
        for a, b in _chunks(s, rows):
            logits = torch.matmul(hidden[a:b], weight.t()).float()          # [c, B, V/tp]
            mx = logits.max(dim=-1)[0]
            if tp:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=tp_group)
            logits -= mx.unsqueeze(-1)
            local = labels[a:b] - vocab_start
            inside = (local >= 0) & (local < vocab_local)
            picked = logits.gather(-1, torch.where(inside, local, 0).unsqueeze(-1)).squeeze(-1)
            picked = torch.where(inside, picked, 0.0)
            sum_exp = logits.exp_().sum(dim=-1)                               # logits now exp(l - max)
            if tp:
                dist.all_reduce(picked, group=tp_group)
                dist.all_reduce(sum_exp, group=tp_group)
            log_sum = torch.log(sum_exp)
            loss[a:b] = log_sum - picked                                      # megatron's formula
            lse[a:b] = log_sum + mx
            if kept_bytes + logits.numel() * 4 <= budget:
                logits /= sum_exp.unsqueeze(-1)                               # the softmax, kept
                kept.append(logits)
                kept_bytes += logits.numel() * 4
        ctx.save_for_backward(hidden, weight, labels, lse, *kept)
        ctx.rows, ctx.vocab_start = rows, vocab_start
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse, *kept = ctx.saved_tensors
        vocab_local = weight.shape[0]
        chunks = _chunks(hidden.shape[0], ctx.rows)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for j, (a, b) in enumerate(chunks):
            h = hidden[a:b]
            if j < len(kept):
                prob = kept[j]                                                # in place, as megatron's
            else:
                prob = torch.matmul(h, weight.t()).float().sub_(lse[a:b].unsqueeze(-1)).exp_()
            local = labels[a:b] - ctx.vocab_start
            inside = (local >= 0) & (local < vocab_local)
            prob.scatter_add_(-1, torch.where(inside, local, 0).unsqueeze(-1), -inside.unsqueeze(-1).to(prob.dtype))
            g = prob.mul_(grad_loss[a:b].unsqueeze(-1)).to(hidden.dtype)      # [c, B, V/tp]
            if grad_hidden is not None:
                grad_hidden[a:b] = torch.matmul(g, weight)
            if ctx.needs_input_grad[1]:
                gw = torch.matmul(g.reshape(-1, vocab_local).t(), h.reshape(-1, h.shape[-1]))
                if len(chunks) == 1:
                    grad_weight = gw
                else:
                    grad_weight = gw.float() if grad_weight is None else grad_weight.add_(gw.float())
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


@dataclass
class DeferredLogits:
    """What the output layer returns under :func:`deferred`: its input and weight, not logits."""

    hidden: torch.Tensor          # [S, B, H] after the TP region function (gathered under SP)
    weight: torch.Tensor          # [V/tp, H]


def chunked_ce(deferred: DeferredLogits, labels_sb: torch.Tensor, layer,
               chunk_bytes: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy ``[S, B]`` (fp32) of the deferred logits against ``labels`` ``[S, B]``."""
    from megatron.core import parallel_state as ps  # deferred: heavy (megatron)

    vocab_local = deferred.weight.shape[0]
    tp_group = getattr(layer, "tp_group", None)
    if tp_group is None and ps.model_parallel_is_initialized():
        tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.is_initialized() else 0
    rows = chunk_rows(vocab_local, labels_sb.shape[1], chunk_bytes)
    return ChunkedVocabParallelCE.apply(deferred.hidden, deferred.weight, labels_sb, rows,
                                        tp_rank * vocab_local, tp_group)


@contextlib.contextmanager
def deferred(enabled: bool = True):
    """While active, an installed model's output layer defers its logits to the chunked CE."""
    prev = getattr(_state, "on", False)
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = prev


def active() -> bool:
    return getattr(_state, "on", False)


def install(model) -> bool:
    """Route ``model``'s (a megatron GPTModel on the last stage) output layer and loss through
    the chunked CE while :func:`deferred` is active.  Returns whether it was installed (False:
    no output layer on this stage, a bias, or megatron's loss fusion configured)."""
    layer = getattr(model, "output_layer", None)
    if layer is None or getattr(model, "_neon_chunked_ce", False):
        return False
    if getattr(layer, "bias", None) is not None or getattr(model.config, "cross_entropy_loss_fusion", False):
        return False
    from megatron.core.tensor_parallel.mappings import (  # deferred: heavy (megatron)
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer_forward = layer.forward
    model_loss = model.compute_language_model_loss

    def output_forward(input_, weight=None, runtime_gather_output=None):
        if not active() or runtime_gather_output:
            return layer_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        w = layer.weight if weight is None else weight
        tp = getattr(layer, "tp_group", None)
        if layer.sequence_parallel:
            h = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=tp)
        elif tp is not None and dist.get_world_size(tp) > 1:
            h = copy_to_tensor_model_parallel_region(input_, group=tp)
        else:
            h = input_
        return DeferredLogits(h, w), None

    def loss(labels, logits):
        if isinstance(logits, DeferredLogits):
            return chunked_ce(logits, labels.transpose(0, 1).contiguous(), layer).transpose(0, 1).contiguous()
        return model_loss(labels, logits)

    layer.forward = output_forward
    model.compute_language_model_loss = loss
    model._neon_chunked_ce = True
    return True
