"""Core attention for megatron-core's local layer spec that runs pieces of documents.

The trainer's micro-batches are packed documents, and under context parallelism (or a
sequence the balancer split across DP ranks) a rank holds *pieces*: any mix of early and late
chunks of a document, beside whole short documents.  megatron-core's local
``DotProductAttention`` cannot run that (it refuses CP; Transformer Engine's CP attention
wants megatron's equal zigzag chunks).  :class:`PieceAttention` can:

- every local token carries its document id and its **true position inside the document**
  (:class:`PieceMap`, set per micro-batch with :func:`piece_map`);
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
the largest contribution, which every rank computes from the balancer's assignment, so no size exchange) is
one collective with a fixed shape, called by every rank of the group at every layer of every
micro-batch slot: it cannot deadlock when ranks hold different numbers of pieces.  Its cost
is each rank receiving all split rows (``(g-1)/g`` of them remote), fine for small exchange
groups; a ring overlapping transfer and compute would be the next step for large CP.

Attention runs per document (block-diagonal), so its cost follows the balancer's cost
model (``sum n_i^2``), not the packed ``S^2`` of a dense mask, and its memory is linear in
length: per document, the local query rows sorted by position split into maximal runs of
contiguous positions; a run's allowed keys (local and gathered, sorted by position) are a
prefix of them, i.e. a causal mask aligned to the lower right, and each run is one call of
torch's fused ``F.scaled_dot_product_attention`` (``is_causal`` when the run has no earlier
keys, ``causal_lower_right`` otherwise; :class:`_Sdpa` says which kernel serves what).  The
piece map precomputes the sorted rows and runs once per micro-batch; per layer it is indexing and
SDPA calls.  The einsum path it replaced (fp32 score matrices, memory in ``L^2``) is kept as
:func:`reference_piece_attention` for tests and ``tools/bench_attention.py`` only.  Without a
piece map set the module is megatron's ``DotProductAttention`` unchanged (dense mask), which is
also the reference the model-level tests compare against.

MLA (deepseek_v3): its core attention (``models/core_attention.SDPACoreAttention``) hands
every piece map (with or without an exchange) to :func:`piece_attention` (value head dim !=
q/k head dim is handled); RoPE of its YaRN rotary is hooked the same way.

Not done: Transformer Engine's fused / CP attention is never used (the local spec has no TE);
the CUDA kernel choices in :class:`_Sdpa` are torch's documented dispatch, not measured here
(no GPU in the session that wrote this).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

_ACTIVE: list["PieceMap"] = []


# --------------------------------------------------------------------------------------
# the piece map of one micro-batch on this rank

@dataclass
class _DocGroup:
    """One document of the micro-batch: its local query rows and all its keys, both sorted by
    true position, and the runs of contiguous query positions that each make one SDPA call."""

    q_idx: torch.Tensor        # local rows of this document, sorted by position (queries)
    q_pos: torch.Tensor        # their positions (CPU; tests and the reference)
    key_idx: torch.Tensor      # rows of [local K ; gathered K] holding the doc's keys, sorted by position
    key_pos: torch.Tensor      # their positions (CPU)
    runs: list[tuple[int, int, int]]   # (q0, q1, lk): queries q_idx[q0:q1] attend keys key_idx[:lk]
    rows: tuple[int, int] | None = None  # q_idx == arange(*rows) and no remote key: slice, not gather

    @property
    def remote(self) -> bool:
        return self.rows is None and self.key_idx.numel() > self.q_idx.numel()


@dataclass
class PieceMap:
    """Where each local token sits in its document, and what comes from the other ranks.

    ``pos`` (int64 ``[S]``) is the true position of every local row; ``groups`` one entry per
    document present; ``pad_idx`` the pad rows (each attends only to itself); ``inverse``
    restores local row order after the per-document outputs are concatenated.  With
    ``send_idx`` not None, every rank of ``group`` sends those local rows (padded to
    ``rows_per_rank``) at every attention layer; gathered row ``j`` is key row ``S + j``.
    Built once per micro-batch and shared by every layer: per layer, attention is indexing
    and one SDPA call per run of contiguous query positions.
    """

    pos: torch.Tensor
    groups: list[_DocGroup]
    pad_idx: torch.Tensor
    inverse: torch.Tensor | None     # None: the concatenated outputs are in row order already
    send_idx: torch.Tensor | None = None
    rows_per_rank: int = 0
    group: object = None
    reads_remote: bool = False       # some local query attends a gathered row
    max_pos: int = 0                 # the largest position in ``pos`` (host int: the rotary table's size)

    @property
    def exchanges(self) -> bool:
        return self.send_idx is not None


def _rows(pieces: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(document, true position) of every row the pieces pack, in packing order (int64)."""
    if not len(pieces):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    lens = np.maximum(arr[:, 2] - arr[:, 1], 0)
    first = np.cumsum(lens) - lens                      # each piece's first row
    doc = np.repeat(arr[:, 0], lens)
    pos = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(arr[:, 1] - first, lens)
    return doc, pos


def _runs(q_pos: np.ndarray, key_pos: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of contiguous positions in the sorted ``q_pos``, each with its key count.

    A run's queries hold positions ``a..b-1``, all among the sorted keys (a rank's own rows are
    keys), so the keys allowed to its query at ``a + t`` are the first ``n_before + t + 1``
    sorted keys, ``n_before`` = keys at positions ``< a``: a causal mask aligned to the lower
    right corner of ``(b - a) x (n_before + b - a)``."""
    n = len(q_pos)
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(q_pos) != 1) + 1
    q0, q1 = np.r_[0, breaks], np.r_[breaks, n]
    before = np.searchsorted(key_pos, q_pos[q0], side="left")
    return list(zip(q0.tolist(), q1.tolist(), (before + q1 - q0).tolist()))


def _groups_of(values: np.ndarray, keep) -> dict[int, np.ndarray]:
    """Row indices of each value (ascending), for the values ``keep`` accepts."""
    order = np.argsort(values, kind="stable")
    uniq, start = np.unique(values[order], return_index=True)
    ends = np.r_[start[1:], len(order)]
    return {int(u): order[a:b] for u, a, b in zip(uniq, start, ends) if keep(int(u))}


def build_piece_map(slot_pieces: Sequence[Sequence[tuple[int, int, int]]], me: int, seq_len: int,
                 group=None, device: torch.device | str = "cpu") -> PieceMap:
    """The piece map of this rank's micro-batch in one slot.

    ``slot_pieces[g]``: the pieces ``(doc, start, end)`` rank ``g`` of the exchange group packs
    in this slot, in packing order (rows ``0..`` of its micro-batch; pad rows follow up to
    ``seq_len`` on this rank).  ``me``: this rank's index in the group.  Every rank calls this
    with the same ``slot_pieces`` and gets a consistent exchange (same ``rows_per_rank``).

    Built with numpy on the host (no per-token Python; per document a few array operations),
    and every index tensor the device needs goes up in one transfer (pinned, non-blocking
    with CUDA): the tensors of the map are views of that one buffer.
    """
    rows = [_rows(p) for p in slot_pieces]
    owners: dict[int, set[int]] = {}
    for g, (d, _) in enumerate(rows):
        for i in np.unique(d).tolist():
            owners.setdefault(i, set()).add(g)
    shared = {i for i, gs in owners.items() if len(gs) > 1}
    ldoc, lpos = rows[me]
    n_real = len(ldoc)
    if n_real > seq_len:
        raise ValueError(f"piece map: {n_real} rows of pieces but a micro-batch of {seq_len}")
    shared_arr = np.fromiter(shared, dtype=np.int64, count=len(shared))
    sent = [np.flatnonzero(np.isin(d, shared_arr)) for d, _ in rows]
    m = max((len(x) for x in sent), default=0)
    rdoc = np.full(len(rows) * m, -1, np.int64)
    rpos = np.zeros(len(rows) * m, np.int64)
    for g, (d, p) in enumerate(rows):
        r = sent[g]
        rpos[g * m:g * m + len(r)] = p[r]
        if g != me:                       # own rows are local keys already
            rdoc[g * m:g * m + len(r)] = d[r]
    first = np.unique(ldoc, return_index=True)
    docs = first[0][np.argsort(first[1], kind="stable")].tolist()     # first-appearance order
    local = _groups_of(ldoc, lambda i: True)
    remote = _groups_of(rdoc, lambda i: i in shared)
    host: list[np.ndarray] = []          # every index the device gets, uploaded as one buffer
    parts = []
    order = []
    for i in docs:
        q = local[i][np.argsort(lpos[local[i]], kind="stable")]
        r = remote.get(i, np.zeros(0, np.int64))
        kpos, kidx = np.concatenate([lpos[q], rpos[r]]), np.concatenate([q, seq_len + r])
        ks = np.argsort(kpos, kind="stable")
        kpos, kidx = kpos[ks], kidx[ks]
        if len(kpos) > 1 and bool((kpos[1:] == kpos[:-1]).any()):
            raise ValueError(f"piece map: document {i} holds a position twice in this slot's pieces "
                             f"{[list(p) for p in slot_pieces]}")
        span = None
        if len(r) == 0 and bool((q == np.arange(q[0], q[0] + len(q))).all()):
            span = (int(q[0]), int(q[0]) + len(q))
        parts.append((len(host), lpos[q], kpos, _runs(lpos[q], kpos), span))
        host += [q, kidx]
        order.append(q)
    pad = np.arange(n_real, seq_len, dtype=np.int64)
    perm = np.concatenate(order + [pad])
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(len(perm))
    identity = bool((perm == np.arange(len(perm))).all())
    full_pos = np.concatenate([lpos, np.zeros(seq_len - n_real, np.int64)])
    tail = len(host)
    host += [full_pos, pad, inverse, sent[me]]
    dev = _upload(host, device)
    groups = [_DocGroup(dev[j], torch.from_numpy(qp), dev[j + 1], torch.from_numpy(kp), runs, span)
              for (j, qp, kp, runs, span) in parts]
    return PieceMap(pos=dev[tail], groups=groups, pad_idx=dev[tail + 1],
                    inverse=None if identity else dev[tail + 2], send_idx=dev[tail + 3] if m > 0 else None,
                    rows_per_rank=m, group=group, reads_remote=any(g.remote for g in groups),
                    max_pos=int(full_pos.max()) if len(full_pos) else 0)


def _upload(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """int64 tensors on ``device`` of ``arrays``: one host buffer, one (pinned, non-blocking) copy."""
    lens = [len(a) for a in arrays]
    flat = torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, np.int64))
    device = torch.device(device)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(torch.split(flat, lens))


@contextlib.contextmanager
def piece_map(pmap: PieceMap | None) -> Iterator[None]:
    """Run the model's forward under ``pmap`` (None: stock dense-mask attention)."""
    if pmap is None:
        yield
        return
    _ACTIVE.append(pmap)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active_piece_map() -> PieceMap | None:
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
    """megatron's ``DotProductAttention`` that runs an :class:`PieceMap` when one is set."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        lay = active_piece_map()
        if lay is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("PieceAttention: packed_seq_params / attention_bias are not supported "
                             "with a piece map (the piece map carries the document structure)")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("PieceAttention: attention dropout is not supported (set attention_dropout: 0)")
        if self.config.apply_query_key_layer_scaling or self.softmax_offset is not None:
            raise ValueError("PieceAttention: query-key layer scaling and softmax offsets are not supported")
        return _piece_attention(query, key, value, lay, self.softmax_scale,
                                self.num_attention_heads_per_partition, self.num_query_groups_per_partition)


def piece_attention(query, key, value, lay: PieceMap, scale: float | None = None) -> torch.Tensor:
    """The piece map's attention for any core attention with megatron's ``[s, b, heads, dim]``
    tensors (heads and groups from the shapes; value head dim may differ, as in MLA);
    ``scale`` None = ``1/sqrt(q head dim)``.  Returns ``[s, b, heads * v_dim]``."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return _piece_attention(query, key, value, lay, scale, query.shape[2], key.shape[2])


def _exchange(k, v, lay: PieceMap, n_groups: int):
    """All-gather the split documents' K/V rows: ``(k_rem, v_rem, buf)``."""
    hn, hv = k.shape[-1], v.shape[-1]
    send = torch.cat([k[lay.send_idx].flatten(1), v[lay.send_idx].flatten(1)], dim=1)
    if send.shape[0] < lay.rows_per_rank:
        send = torch.cat([send, send.new_zeros(lay.rows_per_rank - send.shape[0], send.shape[1])])
    buf = gather_rows(send, lay.group)
    return buf[:, :n_groups * hn].view(-1, n_groups, hn), buf[:, n_groups * hn:].view(-1, n_groups, hv), buf


def _finish(outs, v, lay: PieceMap, n_heads: int, n_groups: int, buf, s: int):
    """Pad rows, local row order, and the gathered buffer kept in the graph (both paths)."""
    hv = v.shape[-1]
    if lay.pad_idx.numel():   # a pad row attends only to itself: its output is its value
        vp = v[lay.pad_idx]
        outs.append(vp[:, :, None, :].expand(-1, n_groups, n_heads // n_groups, hv).reshape(-1, n_heads * hv))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    if lay.inverse is not None:
        out = out[lay.inverse]
    if buf is not None and not lay.reads_remote and buf.requires_grad:
        # this rank's queries see no remote row (e.g. it holds only a document's head), but
        # others need its rows: the gathered buffer must stay in the graph, or autograd skips
        # the gather's backward here and the other ranks wait in its all-reduce forever.
        # Its gradient through this term is zero, so nothing changes numerically.
        out = out + (buf.sum() * 0).to(out.dtype)
    if out.shape[0] != s:
        raise ValueError(f"PieceAttention: the piece map covers {out.shape[0]} rows, the micro-batch has {s}")
    return out.unsqueeze(1)


def _piece_attention(query, key, value, lay: PieceMap, scale: float, n_heads: int,
                     n_groups: int) -> torch.Tensor:
    # query [s, 1, np, hn], key [s, 1, ng, hn], value [s, 1, ng, hv]  ->  [s, 1, np * hv]
    if query.shape[1] != 1:
        raise ValueError(f"PieceAttention runs packed micro-batches (batch 1), got batch {query.shape[1]}")
    q, k, v = query[:, 0], key[:, 0], value[:, 0]
    s = q.shape[0]
    buf = None
    k_all, v_all = k, v
    if lay.exchanges:
        k_rem, v_rem, buf = _exchange(k, v, lay, n_groups)
        if lay.reads_remote:
            k_all, v_all = torch.cat([k, k_rem]), torch.cat([v, v_rem])
    sdpa = _Sdpa(q, k, v, n_heads, n_groups, scale)
    outs = []
    for grp in lay.groups:
        if grp.rows is not None:
            a, b = grp.rows
            qd, kd, vd = q[a:b], k[a:b], v[a:b]
        else:
            qd, kd, vd = q[grp.q_idx], k_all[grp.key_idx], v_all[grp.key_idx]
        for (q0, q1, lk) in grp.runs:
            outs.append(sdpa(qd[q0:q1], kd[:lk], vd[:lk]))
    return _finish(outs, v, lay, n_heads, n_groups, buf, s)


class _Sdpa:
    """One run: ``q [Lq, np, hn]`` against ``k [Lk, ng, hn]``, ``v [Lk, ng, hv]`` (``Lk >= Lq``),
    causal aligned to the lower right, by ``F.scaled_dot_product_attention`` -> ``[Lq, np * hv]``.

    Kernel choice (what the dispatcher can run with memory linear in length):

    - ``Lk == Lq``: ``is_causal=True``.  ``Lk > Lq`` (a late piece: keys of earlier pieces
      first): ``causal_lower_right(Lq, Lk)``; CUDA runs it as flash (is_causal is lower-right
      there) or memory-efficient attention (``custom_mask_type``); the CPU materialises an
      ``Lq x Lk`` bool mask (only for split pieces, never over the packed micro-batch) and runs
      its flash kernel with it.
    - GQA: ``enable_gqa=True`` where the kernel takes it (the CPU flash kernel; CUDA flash in
      bf16/fp16); otherwise (CUDA memory-efficient attention, e.g. fp32) K/V are expanded to
      the query heads (``[Lk, np, dim]`` copies: linear).
    - ``hv != hn`` (MLA): CUDA's memory-efficient / cuDNN kernels take it; the CPU flash kernel
      does not (torch 2.13 falls back to the math kernel, an ``[np, Lq, Lk]`` fp32 score
      matrix), so on the CPU V is zero-padded to ``hn`` and the output sliced back (exact:
      the padded columns of the output are zero and get no gradient).
    - dtype: the inputs' (bf16 runs in bf16; the kernels accumulate the softmax in fp32).
    """

    def __init__(self, q, k, v, n_heads: int, n_groups: int, scale: float):
        self.n_heads, self.n_groups, self.scale = n_heads, n_groups, scale
        self.hv = v.shape[-1]
        cpu = q.device.type == "cpu"
        self.pad_v = q.shape[-1] - v.shape[-1] if cpu and v.shape[-1] != q.shape[-1] else 0
        self.gqa = n_heads != n_groups
        self.native_gqa = cpu or (self.gqa and _flash_takes(q, k, v))

    def __call__(self, qr, kr, vr):
        lq, lk = qr.shape[0], kr.shape[0]
        if self.pad_v:
            vr = F.pad(vr, (0, self.pad_v))
        if self.gqa and not self.native_gqa:
            rep = self.n_heads // self.n_groups
            kr, vr = kr.repeat_interleave(rep, dim=1), vr.repeat_interleave(rep, dim=1)
        # [L, heads, dim] -> [1, heads, L, dim]
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (qr, kr, vr))
        gqa = self.gqa and self.native_gqa
        if lk == lq:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(lq, lk), scale=self.scale,
                                               enable_gqa=gqa)
        if self.pad_v:
            o = o[..., :self.hv]
        return o[0].transpose(0, 1).reshape(lq, self.n_heads * self.hv)


_FLASH_GQA: dict = {}


def _flash_takes(q, k, v) -> bool:
    """Whether CUDA's flash kernel runs these shapes/dtypes with GQA unexpanded (cached)."""
    key = (q.device, q.dtype, q.shape[-1], v.shape[-1], q.shape[1], k.shape[1])
    if key not in _FLASH_GQA:
        qb, kb, vb = (t[:1].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        _FLASH_GQA[key] = bool(can_use_flash_attention(SDPAParams(qb, kb, vb, None, 0.0, True, True), False))
    return _FLASH_GQA[key]


def reference_piece_attention(query, key, value, lay: PieceMap, scale: float | None = None) -> torch.Tensor:
    """The einsum reference of :func:`piece_attention`, for tests and ``tools/bench_attention.py``
    only, never the trainer's path: per document an fp32 ``[groups, rep, nq, nk]`` score matrix
    masked by true position (memory in ``L^2``).  Same exchange, same output layout."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    n_heads, n_groups = query.shape[2], key.shape[2]
    q, k, v = query[:, 0], key[:, 0], value[:, 0]
    s, hn, hv = q.shape[0], k.shape[-1], v.shape[-1]
    rep = n_heads // n_groups
    buf = None
    k_all, v_all = k, v
    if lay.exchanges:
        k_rem, v_rem, buf = _exchange(k, v, lay, n_groups)
        k_all, v_all = torch.cat([k, k_rem]), torch.cat([v, v_rem])
    outs = []
    for grp in lay.groups:
        qd, kd, vd = q[grp.q_idx], k_all[grp.key_idx], v_all[grp.key_idx]
        mask = (grp.key_pos[None, :] <= grp.q_pos[:, None]).to(q.device)
        nq = qd.shape[0]
        scores = torch.einsum("qgrd,kgd->grqk", qd.view(nq, n_groups, rep, hn), kd).float() * scale
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(vd.dtype)
        outs.append(torch.einsum("grqk,kgd->qgrd", probs, vd).reshape(nq, n_heads * hv))
    return _finish(outs, v, lay, n_heads, n_groups, buf, s)


def hook_spec(spec) -> int:
    """Use :class:`PieceAttention` wherever ``spec`` (a layer spec, or a block spec with
    ``layer_specs``) has megatron's local ``DotProductAttention``; returns how many were
    replaced.  Other core attentions (e.g. MLA's) are left alone: they run without piece maps."""
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
    """Make every rotary embedding of ``model`` rotate by the active piece map's positions.

    Without a piece map set they behave as before (position = packed row).  Returns how many
    rotary modules were hooked.  Handles megatron's ``RotaryEmbedding`` (GPT) and
    ``YarnRotaryEmbedding`` (MLA; its forward returns ``(emb, mscale)``).
    """
    n = 0
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding) and "forward" not in vars(mod):
            mod.forward = _positioned(mod)
            n += 1
    return n


def _positioned(mod):
    base = type(mod).forward

    def forward(max_seq_len, *args, **kwargs):
        lay = active_piece_map()
        if lay is None:
            return base(mod, max_seq_len, *args, **kwargs)
        if lay.pos.numel() != max_seq_len:
            raise ValueError(f"rotary embedding asked for {max_seq_len} positions, the piece map has "
                             f"{lay.pos.numel()} rows")
        top = lay.max_pos + 1    # a host int: no device read-back
        out = base(mod, top, *args, **kwargs)
        if isinstance(out, tuple):
            return (out[0][lay.pos.to(out[0].device)],) + tuple(out[1:])
        return out[lay.pos.to(out.device)]

    return forward
