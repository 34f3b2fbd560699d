"""Micro-batches from trajectories: packing, label alignment, and router-replay alignment.

Format: **packing, B = 1**.  The trajectories of one micro-batch are concatenated into one
sequence ``[1, S]`` (megatron sees ``[S, B=1]``); a block-diagonal causal attention mask keeps
each document's tokens from attending to any other document.  Position ids restart at 0 for
every document (they are passed to megatron, whose RoPE ignores them: it rotates by absolute
packed position, and RoPE scores depend only on the distance between two tokens of the same
document, so the offset changes nothing but rounding).  ``S`` is padded up to a multiple of
``pad_multiple`` (the TP size under sequence parallelism, which splits S across TP ranks)
with pad tokens that form their own one-token documents and carry no loss.

Per document of ``n`` tokens the model input is ``tokens[0 : n-1]`` and the label at input
position ``t`` is ``tokens[t+1]``: the last token is never fed (it has no label, and its route
row is the placeholder the store contract describes).  Everything per label token
(loss mask, engine logprob, weight version) is taken at ``t+1``; the route fed to router
replay at input position ``t`` is ``routed_experts[t]``: the experts token ``t`` was routed
to when the engine forwarded it.

Router replay (megatron-core ``RouterReplay.set_replay_data``) wants one int tensor
``[tokens, top_k]`` per local MoE layer, tokens in megatron's flattened ``[S, B]`` order as
the router of *this rank* sees them.  With B = 1 that is sequence order; under sequence
parallelism TP rank ``r`` routes the contiguous slice ``[r*S/tp, (r+1)*S/tp)``; expert
parallelism routes before dispatch, so it changes nothing; pipeline stages would take their
own layers' rows (``layers`` argument).

Pure functions of numpy arrays and trajectories; no model, no process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from neon_hpc.balance.assignment import Piece  # (trajectory index, start, end) in input-token space


@dataclass
class MicroBatch:
    """One packed micro-batch (all tensors batch-first, B = 1)."""

    input_ids: torch.Tensor          # int64 [1, S]
    position_ids: torch.Tensor       # int64 [1, S], restart at 0 per document
    attention_mask: torch.Tensor | None   # bool [1, 1, S, S], True = masked (megatron's convention);
                                     # None when built with dense_mask=False (piece attention)
    labels: torch.Tensor             # int64 [1, S]
    loss_mask: torch.Tensor          # float32 [1, S], 1 where the label token was generated
    behaviour_logprobs: torch.Tensor # float32 [1, S], engine logprob of the label token
    versions: torch.Tensor           # int32 [1, S], weight version of the label token (-1: none)
    advantages: torch.Tensor         # float32 [1, S], the label token's trajectory advantage
    routed_experts: np.ndarray | None   # int64 [S, num_moe_layers, top_k] or None (no replay)
    doc_ids: torch.Tensor | None = None   # int64 [S]: trajectory index per row; pads -1, -2, ...
    pieces: list[Piece] = field(default_factory=list)
    doc_starts: list[int] = field(default_factory=list)
    real_tokens: int = 0             # tokens before padding
    routed_experts_missing: int = 0  # documents whose routes were absent or invalid
    routed_experts_dev: torch.Tensor | None = None  # int64 [num_moe_layers, S, top_k] on the device (to_device)
    host_buffer: torch.Tensor | None = None  # the pinned buffer an upload reads (alive until it is used)

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def input_lengths(trajectories: Sequence[Any]) -> list[int]:
    """Model-input length of each trajectory: all tokens but the last (see module docstring)."""
    return [max(len(t.tokens) - 1, 0) for t in trajectories]


def piece_mask(doc_ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """``[1, 1, S, S]`` bool, True where forbidden: same document and key position <= query position."""
    same = doc_ids[:, None] == doc_ids[None, :]
    causal = positions[None, :] <= positions[:, None]
    s = len(doc_ids)
    return torch.from_numpy(~(same & causal)).view(1, 1, s, s)


def block_causal_mask(doc_lengths: Sequence[int]) -> torch.Tensor:
    """``[1, 1, S, S]`` bool, True where attention is forbidden: causal within each document."""
    s = int(sum(doc_lengths))
    doc = np.repeat(np.arange(len(doc_lengths)), doc_lengths)
    same = doc[:, None] == doc[None, :]
    causal = np.tril(np.ones((s, s), dtype=bool))
    return torch.from_numpy(~(same & causal)).view(1, 1, s, s)


def check_routes(routes: Any, n_tokens: int, num_layers: int, top_k: int,
                 num_experts: int) -> str | None:
    """Why the routes of one trajectory cannot be replayed, or None when they can."""
    if routes is None:
        return "no routed_experts recorded"
    r = np.asarray(routes)
    if r.shape != (n_tokens, num_layers, top_k):
        return f"routed_experts shape {r.shape} != (tokens {n_tokens}, moe layers {num_layers}, top_k {top_k})"
    if n_tokens > 1:
        used = r[: n_tokens - 1]
        if used.min() < 0 or used.max() >= num_experts:
            return f"expert id out of range [0, {num_experts})"
        if top_k > 1 and (np.diff(np.sort(used, axis=-1), axis=-1) == 0).any():
            return "a token is routed to the same expert twice"
    return None


def _pad_route_rows(n: int, num_layers: int, top_k: int) -> np.ndarray:
    # Pad tokens carry no loss; any distinct experts do.  Experts 0..k-1 keep it deterministic.
    return np.broadcast_to(np.arange(top_k, dtype=np.int64), (n, num_layers, top_k)).copy()


def packed_length(pieces: Sequence[Piece], pad_multiple: int = 1, min_len: int = 0) -> int:
    """``S`` of the micro-batch :func:`build_microbatch` packs from ``pieces``."""
    s = max(int(sum(e - s for (_, s, e) in pieces)), min_len, 1)
    return -(-s // pad_multiple) * pad_multiple


def build_microbatch(trajectories: Sequence[Any], pieces: Sequence[Piece], advantages: Sequence[float],
                     pad_multiple: int = 1, min_len: int = 0,
                     route_shape: tuple[int, int, int] | None = None, dense_mask: bool = True) -> MicroBatch:
    """Pack ``pieces`` into one micro-batch.

    A piece ``(i, start, end)`` is input tokens ``[start, end)`` of trajectory ``i`` (whole:
    ``(i, 0, input length)``); its labels, loss mask, logprobs, versions and routes are the
    same token range shifted as the module docstring says, and its positions are its true
    positions ``start..end-1`` in the document.  ``dense_mask=False`` skips the ``S x S``
    mask (the trainer's piece attention takes the document structure from ``doc_ids`` and
    ``position_ids``; with split pieces the mask alone cannot describe keys on other ranks).

    ``route_shape = (num_moe_layers, top_k, num_experts)`` turns on route packing; a
    micro-batch in which any document lacks valid routes gets ``routed_experts = None`` (it then runs
    without replay) and counts those documents in ``routed_experts_missing``.  An empty ``pieces``
    gives a micro-batch of pad tokens only (ranks must run the same number of forwards when
    experts or tensors are split across them).
    """
    ids, pos, labels, lmask, lp, ver, adv, doc_lens, route_parts = [], [], [], [], [], [], [], [], []
    docs: list[np.ndarray] = []
    missing = 0
    for (i, start, end) in pieces:
        t = trajectories[i]
        n_in = len(t.tokens) - 1
        if not 0 <= start < end <= n_in:
            if n_in < 1 and start == end == 0:
                continue
            raise ValueError(f"piece {(i, start, end)} of trajectory {getattr(t, 'task_id', i)} "
                             f"(input length {n_in}) is out of range")
        tok = np.asarray(t.tokens, dtype=np.int64)
        n = end - start
        ids.append(tok[start:end])
        labels.append(tok[start + 1:end + 1])
        pos.append(np.arange(start, end, dtype=np.int64))
        lmask.append(np.asarray(t.loss_mask, dtype=np.float32)[start + 1:end + 1])
        lp.append(np.asarray(t.logprobs, dtype=np.float32)[start + 1:end + 1])
        ver.append(np.asarray(t.versions, dtype=np.int32)[start + 1:end + 1])
        adv.append(np.full(n, advantages[i], dtype=np.float32))
        docs.append(np.full(n, i, dtype=np.int64))
        doc_lens.append(n)
        if route_shape is not None:
            layers, k, experts = route_shape
            why = check_routes(getattr(t, "routed_experts", None), len(tok), layers, k, experts)
            if why is None:
                route_parts.append(np.asarray(t.routed_experts, dtype=np.int64)[start:end])
            else:
                missing += 1
                route_parts.append(None)
    real = int(sum(doc_lens))
    n_pad = packed_length([(0, 0, real)], pad_multiple, min_len) - real
    if n_pad:
        ids.append(np.zeros(n_pad, np.int64))
        labels.append(np.zeros(n_pad, np.int64))
        pos.append(np.zeros(n_pad, np.int64))
        lmask.append(np.zeros(n_pad, np.float32))
        lp.append(np.zeros(n_pad, np.float32))
        ver.append(np.full(n_pad, -1, np.int32))
        adv.append(np.zeros(n_pad, np.float32))
        doc_lens.extend([1] * n_pad)
        docs.append(-1 - np.arange(n_pad, dtype=np.int64))
    routes = None
    if route_shape is not None and missing == 0:
        layers, k, _ = route_shape
        routes = np.concatenate(route_parts + [_pad_route_rows(n_pad, layers, k)], axis=0)
    cat = lambda xs: torch.from_numpy(np.concatenate(xs)).unsqueeze(0)
    doc_ids = np.concatenate(docs)
    mask = piece_mask(doc_ids, np.concatenate(pos)) if dense_mask else None
    return MicroBatch(
        input_ids=cat(ids), position_ids=cat(pos), attention_mask=mask, doc_ids=torch.from_numpy(doc_ids),
        labels=cat(labels), loss_mask=cat(lmask), behaviour_logprobs=cat(lp), versions=cat(ver),
        advantages=cat(adv), routed_experts=routes, pieces=list(pieces),
        doc_starts=list(np.cumsum([0] + doc_lens[:-1]).tolist()), real_tokens=real,
        routed_experts_missing=missing)


# the per-token tensors the device reads, in upload order (int64 first: every slice stays aligned)
_INT_FIELDS = ("input_ids", "position_ids", "labels")
_FLOAT_FIELDS = ("loss_mask", "behaviour_logprobs", "advantages")


def to_device(mb: MicroBatch, device: torch.device | str) -> MicroBatch:
    """``mb`` with its model inputs, loss tensors and replay routes on ``device``, in one transfer.

    On CUDA the int64 inputs (ids, positions, labels), the routes (layer-major ``[L, S, k]``) and
    the float32 loss tensors (mask, behaviour logprob, advantage) are packed into one pinned
    host buffer and copied with ``non_blocking`` (the copy is ordered before any kernel that
    reads it; the buffer is kept in ``host_buffer``); the tensors of the result are views of
    the one device buffer.  On CPU ``mb`` is returned unchanged (nothing pinned, nothing copied).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return mb
    host, layout = pack(mb, pin=True)
    return unpack(mb, host.to(device, non_blocking=True), layout, host_buffer=host)


def pack(mb: MicroBatch, pin: bool = False) -> tuple[torch.Tensor, list[tuple[str, torch.dtype, int]]]:
    """One uint8 host buffer holding :func:`to_device`'s tensors, and its layout (name, dtype, elements)."""
    ints = [(f, getattr(mb, f).reshape(-1)) for f in _INT_FIELDS]
    if mb.routed_experts is not None:
        routes = np.ascontiguousarray(np.moveaxis(mb.routed_experts, 1, 0))
        ints.append(("routed_experts_dev", torch.from_numpy(routes).reshape(-1)))
    floats = [(f, getattr(mb, f).reshape(-1).to(torch.float32)) for f in _FLOAT_FIELDS]
    ints = [(f, t.to(torch.int64)) for f, t in ints]
    parts = [t.contiguous().view(torch.uint8) for _, t in ints + floats]
    host = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8, pin_memory=pin)
    torch.cat(parts, out=host)
    return host, [(f, torch.int64 if i < len(ints) else torch.float32, t.numel())
                  for i, (f, t) in enumerate(ints + floats)]


def unpack(mb: MicroBatch, buf: torch.Tensor, layout: list[tuple[str, torch.dtype, int]],
           host_buffer: torch.Tensor | None = None) -> MicroBatch:
    """``mb`` with the tensors of ``layout`` replaced by views of ``buf`` (:func:`pack`'s bytes)."""
    fields, at = {}, 0
    for name, dtype, n in layout:
        size = n * torch.empty((), dtype=dtype).element_size()
        fields[name] = buf[at:at + size].view(dtype)
        at += size
    for f in _INT_FIELDS + _FLOAT_FIELDS:
        fields[f] = fields[f].view(mb.input_ids.shape)
    if "routed_experts_dev" in fields:
        s, layers, k = mb.routed_experts.shape
        fields["routed_experts_dev"] = fields["routed_experts_dev"].view(layers, s, k)
    return dataclasses.replace(mb, **fields, host_buffer=host_buffer)


def replay_rows(mb: MicroBatch, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False,
                layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """:func:`replay_tensors` of ``mb``: views of the uploaded routes when :func:`to_device` ran."""
    if mb.routed_experts_dev is None:
        return replay_tensors(mb.routed_experts, tp_rank, tp_size, sequence_parallel, layers)
    r = mb.routed_experts_dev
    r = r[:, _sp_rows(r.shape[1], tp_rank, tp_size, sequence_parallel)]
    return [r[l] for l in (range(r.shape[0]) if layers is None else layers)]


def _sp_rows(s: int, tp_rank: int, tp_size: int, sequence_parallel: bool) -> slice:
    """The token rows of a length-``s`` sequence this TP rank holds (all of them without sequence parallelism)."""
    if not (sequence_parallel and tp_size > 1):
        return slice(None)
    if s % tp_size:
        raise ValueError(f"sequence length {s} is not a multiple of TP size {tp_size}; build the "
                         f"micro-batch with pad_multiple={tp_size}")
    chunk = s // tp_size
    return slice(tp_rank * chunk, (tp_rank + 1) * chunk)


def replay_tensors(routes: np.ndarray, tp_rank: int = 0, tp_size: int = 1,
                   sequence_parallel: bool = False,
                   layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    """The list megatron's ``RouterReplay.set_replay_data`` takes on this rank.

    ``routes`` is ``[S, num_moe_layers, top_k]`` for a B = 1 micro-batch; returns one int64
    ``[tokens_on_this_rank, top_k]`` tensor per MoE layer held by this rank, in layer order.
    """
    routes = routes[_sp_rows(routes.shape[0], tp_rank, tp_size, sequence_parallel)]
    layer_ids = range(routes.shape[1]) if layers is None else layers
    return [torch.from_numpy(np.ascontiguousarray(routes[:, l, :])) for l in layer_ids]
