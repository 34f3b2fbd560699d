"""Core attention for megatron-core's local layer spec that runs pieces of documents.

The trainer's micro-batches are packed documents, and under context parallelism (or a
sequence the balancer split across DP ranks) a rank holds *pieces*: any mix of early and late
chunks of a document, beside whole short documents.  megatron-core's local
``DotProductAttention`` cannot run that (it refuses CP; Transformer Engine's CP attention
wants megatron's equal zigzag chunks).  :class:`PieceAttention` can:

- every local token carries its document id and its **true position inside the document**
  (:class:`AttentionLayout`, set per micro-batch with :func:`attention_layout`);
- RoPE rotates each token by that position (:func:`use_document_positions` makes the model's
  rotary embeddings index their table by it);
- the causal mask is by document position: a query attends a key of the same document at a
  position ``<=`` its own, wherever that key lives;
- keys and values of the documents that span ranks are **all-gathered** in the exchange group
  with autograd (:class:`_GatherRows`: backward sums every rank's gradient of the gathered
  rows and returns each rank its own slice), so the backward pass is exact.

Why all-gather, not a ring: a rank's pieces are arbitrary (not ``2*cp`` equal chunks), so
a ring would need a per-step mask of every (query piece, key piece) pair and at CP = 2 moves
the same bytes; one all-gather per layer of only the split documents' K/V rows (padded to
the largest contribution, which every rank computes from the plan, so no size exchange) is
one collective with a fixed shape, called by every rank of the group at every layer of every
micro-batch slot: it cannot deadlock when ranks hold different numbers of pieces.  Its cost
is each rank receiving all split rows (``(g-1)/g`` of them remote), fine for small exchange
groups; a ring overlapping transfer and compute would be the next step for large CP.

Attention runs per document (block-diagonal), so its cost follows the balancer's cost
model (``sum n_i^2``), not the packed ``S^2`` of a dense mask.  Without a layout set the
module is megatron's ``DotProductAttention`` unchanged (dense mask), which is also the
reference the tests compare against.

MLA (deepseek_v3): its core attention (``models/core_attention.SDPACoreAttention``) reads
the same layout and hands micro-batches with an exchange to :func:`piece_attention` (value
head dim != q/k head dim is handled); RoPE of its YaRN rotary is hooked the same way.

Not done: Transformer Engine's CP attention is never used (the local spec has no TE); on
CUDA this module runs as plain torch ops (untested on GPU here).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron.core.transformer.dot_product_attention import DotProductAttention

_ACTIVE: list["AttentionLayout"] = []


# --------------------------------------------------------------------------------------
# the layout of one micro-batch on this rank

@dataclass
class _DocGroup:
    q_idx: torch.Tensor        # local rows of this document (queries; also its local keys)
    remote_idx: torch.Tensor   # rows of the gathered buffer holding this document's other pieces
    mask: torch.Tensor         # bool [nq, n_local + n_remote], True = may attend


@dataclass
class AttentionLayout:
    """Where each local token sits in its document, and what comes from the other ranks.

    ``pos`` (int64 ``[S]``) is the true position of every local row; ``groups`` one entry per
    document present; ``pad_idx`` the pad rows (each attends only to itself); ``inverse``
    restores local row order after the per-document outputs are concatenated.  With
    ``send_idx`` not None, every rank of ``group`` sends those local rows (padded to
    ``rows_per_rank``) at every attention layer.
    """

    pos: torch.Tensor
    groups: list[_DocGroup]
    pad_idx: torch.Tensor
    inverse: torch.Tensor
    send_idx: torch.Tensor | None = None
    rows_per_rank: int = 0
    group: object = None

    @property
    def exchanges(self) -> bool:
        return self.send_idx is not None


def _rows(pieces: Sequence[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    doc, pos = [], []
    for (i, s, e) in pieces:
        doc.extend([i] * (e - s))
        pos.extend(range(s, e))
    return doc, pos


def build_layout(slot_pieces: Sequence[Sequence[tuple[int, int, int]]], me: int, seq_len: int,
                 group=None, device: torch.device | str = "cpu") -> AttentionLayout:
    """The layout of this rank's micro-batch in one slot.

    ``slot_pieces[g]``: the pieces ``(doc, start, end)`` rank ``g`` of the exchange group packs
    in this slot, in packing order (rows ``0..`` of its micro-batch; pad rows follow up to
    ``seq_len`` on this rank).  ``me``: this rank's index in the group.  Every rank calls this
    with the same ``slot_pieces`` and gets a consistent exchange (same ``rows_per_rank``).
    """
    owners: dict[int, set[int]] = {}
    for g, pieces in enumerate(slot_pieces):
        for (i, s, e) in pieces:
            if e > s:
                owners.setdefault(i, set()).add(g)
    shared = {i for i, gs in owners.items() if len(gs) > 1}
    doc, pos = _rows(slot_pieces[me])
    n_real = len(doc)
    if n_real > seq_len:
        raise ValueError(f"layout: {n_real} rows of pieces but a micro-batch of {seq_len}")
    sent = [[r for r, d in enumerate(_rows(p)[0]) if d in shared] for p in slot_pieces]
    m = max((len(x) for x in sent), default=0)
    remote_doc: list[int] = []
    remote_pos: list[int] = []
    for g, pieces in enumerate(slot_pieces):
        d, p = _rows(pieces)
        rows = sent[g]
        blk_doc = [d[r] for r in rows] + [-1] * (m - len(rows))
        blk_pos = [p[r] for r in rows] + [0] * (m - len(rows))
        if g == me:   # own rows are local keys already
            blk_doc = [-1] * m
        remote_doc.extend(blk_doc)
        remote_pos.extend(blk_pos)
    rdoc = torch.tensor(remote_doc, dtype=torch.long)
    rpos = torch.tensor(remote_pos, dtype=torch.long)
    ldoc = torch.tensor(doc, dtype=torch.long)
    lpos = torch.tensor(pos, dtype=torch.long)
    groups, order = [], []
    for i in dict.fromkeys(doc):          # documents in first-appearance order
        q = torch.nonzero(ldoc == i).flatten()
        r = torch.nonzero(rdoc == i).flatten() if i in shared else torch.zeros(0, dtype=torch.long)
        kpos = torch.cat([lpos[q], rpos[r]])
        mask = kpos[None, :] <= lpos[q][:, None]
        groups.append(_DocGroup(q.to(device), r.to(device), mask.to(device)))
        order.append(q)
    pad = torch.arange(n_real, seq_len, dtype=torch.long)
    order.append(pad)
    perm = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    full_pos = torch.cat([lpos, torch.zeros(seq_len - n_real, dtype=torch.long)])
    send = None
    if m > 0:
        send = torch.tensor(sent[me], dtype=torch.long).to(device)
    return AttentionLayout(pos=full_pos.to(device), groups=groups, pad_idx=pad.to(device),
                           inverse=inverse.to(device), send_idx=send, rows_per_rank=m, group=group)


@contextlib.contextmanager
def attention_layout(layout: AttentionLayout | None) -> Iterator[None]:
    """Run the model's forward under ``layout`` (None: stock dense-mask attention)."""
    if layout is None:
        yield
        return
    _ACTIVE.append(layout)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active_layout() -> AttentionLayout | None:
    return _ACTIVE[-1] if _ACTIVE else None


# --------------------------------------------------------------------------------------
# K/V exchange with an exact backward

class _GatherRows(torch.autograd.Function):
    """All-gather ``[m, f]`` from every rank of ``group`` -> ``[world * m, f]``.

    Backward: every rank's gradient of the gathered buffer is summed (reduce-scatter on NCCL,
    all-reduce then own slice on gloo, which has no reduce-scatter) and each rank keeps the
    slice of its own rows, i.e. the sum of the gradients every rank's queries sent to them.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, me = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        m = grad.shape[0] // world
        if dist.get_backend(group) == "nccl":
            out = torch.empty((m,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad[me * m:(me + 1) * m], None


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherRows.apply(x, group)


# --------------------------------------------------------------------------------------
# the module

class PieceAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` that runs an :class:`AttentionLayout` when one is set."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        lay = active_layout()
        if lay is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("PieceAttention: packed_seq_params / attention_bias are not supported "
                             "with a piece layout (the layout carries the document structure)")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("PieceAttention: attention dropout is not supported (set attention_dropout: 0)")
        if self.config.apply_query_key_layer_scaling or self.softmax_offset is not None:
            raise ValueError("PieceAttention: query-key layer scaling and softmax offsets are not supported")
        return _piece_attention(query, key, value, lay, self.softmax_scale,
                                self.num_attention_heads_per_partition, self.num_query_groups_per_partition)


def piece_attention(query, key, value, lay: AttentionLayout, scale: float | None = None) -> torch.Tensor:
    """The layout's attention for any core attention with megatron's ``[s, b, heads, dim]``
    tensors (heads and groups from the shapes; value head dim may differ, as in MLA);
    ``scale`` None = ``1/sqrt(q head dim)``.  Returns ``[s, b, heads * v_dim]``."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _piece_attention(query, key, value, lay, scale, query.shape[2], key.shape[2])


def _piece_attention(query, key, value, lay: AttentionLayout, scale: float, n_heads: int,
                     n_groups: int) -> torch.Tensor:
    # query [s, 1, np, hn], key [s, 1, ng, hn], value [s, 1, ng, hv]  ->  [s, 1, np * hv]
    if query.shape[1] != 1:
        raise ValueError(f"PieceAttention runs packed micro-batches (batch 1), got batch {query.shape[1]}")
    q, k, v = query[:, 0], key[:, 0], value[:, 0]
    s, hn, hv = q.shape[0], k.shape[-1], v.shape[-1]
    rep = n_heads // n_groups
    if lay.exchanges:
        send = torch.cat([k[lay.send_idx].flatten(1), v[lay.send_idx].flatten(1)], dim=1)
        if send.shape[0] < lay.rows_per_rank:
            send = torch.cat([send, send.new_zeros(lay.rows_per_rank - send.shape[0], send.shape[1])])
        buf = gather_rows(send, lay.group)
        k_rem = buf[:, :n_groups * hn].view(-1, n_groups, hn)
        v_rem = buf[:, n_groups * hn:].view(-1, n_groups, hv)
    outs = []
    used_remote = False
    for grp in lay.groups:
        qd = q[grp.q_idx]
        kd, vd = k[grp.q_idx], v[grp.q_idx]
        if grp.remote_idx.numel():
            used_remote = True
            kd = torch.cat([kd, k_rem[grp.remote_idx]])
            vd = torch.cat([vd, v_rem[grp.remote_idx]])
        nq = qd.shape[0]
        qg = qd.view(nq, n_groups, rep, hn)
        scores = torch.einsum("qgrd,kgd->grqk", qg, kd).float() * scale
        scores = scores.masked_fill(~grp.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vd.dtype)
        o = torch.einsum("grqk,kgd->qgrd", probs, vd)
        outs.append(o.reshape(nq, n_heads * hv))
    if lay.pad_idx.numel():   # a pad row attends only to itself: its output is its value
        vp = v[lay.pad_idx]
        outs.append(vp[:, :, None, :].expand(-1, n_groups, rep, hv).reshape(-1, n_heads * hv))
    out = torch.cat(outs)[lay.inverse]
    if lay.exchanges and not used_remote and buf.requires_grad:
        # this rank's queries see no remote row (e.g. it holds only a document's head), but
        # others need its rows: the gathered buffer must stay in the graph, or autograd skips
        # the gather's backward here and the other ranks wait in its all-reduce forever.
        # Its gradient through this term is zero, so nothing changes numerically.
        out = out + (buf.sum() * 0).to(out.dtype)
    if out.shape[0] != s:
        raise ValueError(f"PieceAttention: layout covers {out.shape[0]} rows, the micro-batch has {s}")
    return out.unsqueeze(1)


def hook_spec(spec) -> int:
    """Use :class:`PieceAttention` wherever ``spec`` (a layer spec, or a block spec with
    ``layer_specs``) has megatron's local ``DotProductAttention``; returns how many were
    replaced.  Other core attentions (e.g. MLA's) are left alone: they run without layouts."""
    layers = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    if layers is None:
        layers = getattr(spec, "layer_specs", None) or [spec]
    n = 0
    for layer in layers:
        sub = getattr(getattr(layer.submodules, "self_attention", None), "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = PieceAttention
            n += 1
    return n


# --------------------------------------------------------------------------------------
# RoPE by position inside the document

def use_document_positions(model) -> int:
    """Make every rotary embedding of ``model`` rotate by the active layout's positions.

    Without a layout set they behave as before (position = packed row).  Returns how many
    rotary modules were hooked.  Handles megatron's ``RotaryEmbedding`` (GPT) and
    ``YarnRotaryEmbedding`` (MLA; its forward returns ``(emb, mscale)``).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    n = 0
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding) and "forward" not in vars(mod):
            mod.forward = _positioned(mod)
            n += 1
    return n


def _positioned(mod):
    base = type(mod).forward

    def forward(max_seq_len, *args, **kwargs):
        lay = active_layout()
        if lay is None:
            return base(mod, max_seq_len, *args, **kwargs)
        if lay.pos.numel() != max_seq_len:
            raise ValueError(f"rotary embedding asked for {max_seq_len} positions, the layout has "
                             f"{lay.pos.numel()} rows")
        top = int(lay.pos.max()) + 1 if lay.pos.numel() else 1
        out = base(mod, top, *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0][lay.pos.to(out[0].device)],) + tuple(out[1:])
        return out[lay.pos.to(out.device)]

    return forward
