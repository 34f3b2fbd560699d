"""The subset of SGLang's HTTP API we speak, written down once and checked at the edge.

Read from SGLang's source (``managers/io_struct.py`` ``GenerateReqInput``,
``sampling/sampling_params.py`` ``SamplingParams``, ``managers/tokenizer_manager.py``
``_handle_batch_output``); both our embedded engine and our client follow it, so the client
works unchanged against a real SGLang server.

``POST /generate`` request (JSON)::

    input_ids                 list[int] (non-empty)  or list[list[int]] (a batch)
    sampling_params           {temperature, top_p, top_k, max_new_tokens, stop_token_ids,
                               ignore_eos, sampling_seed, ...}   (SGLang names)
    return_logprob            bool
    return_routed_experts     bool  (server started with --enable-return-routed-experts)
    routed_experts_start_len  int in [0, prompt_tokens]; 0 = full
    rid                       str (optional; echoed as meta_info.id), or for a batch a list
                              of one str per sequence
    stream                    false (streaming is not part of our subset)

Response (one object; a list of them for a batch)::

    output_ids   list[int]  (includes a matched stop token)
    meta_info    {id, finish_reason: {"type": "stop", "matched": int} | {"type": "length",
                  "length": int} | {"type": "abort", "message": str},
                  prompt_tokens, completion_tokens, cached_tokens, weight_version (str),
                  output_token_logprobs: [[logprob, token_id, null], ...]   (return_logprob),
                  routed_experts: base64(little-endian, C order)              (return_routed_experts),
                  routed_experts_dtype: "int32" | "uint16" | "uint8" (optional; absent = int32)}

``routed_experts`` has logical shape ``[seqlen - 1 - start, num_hidden_layers, top_k]`` (SGLang's
layout: one row per decoder layer, zeros for layers that do not route, e.g. DeepSeek-V3's dense
first layers; no columns for shared experts) where
``seqlen = prompt_tokens + completion_tokens``: row ``i`` holds the experts that token
``start + i`` was routed to when it was forwarded.  The last token was never forwarded,
so it has no row.

Errors: HTTP 400 with ``{"error": {"message": ...}}`` naming the field, for every malformed body of
every endpoint (control endpoints: :func:`parse_object`); 500 only for an engine fault.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# SamplingParams fields we implement; other SGLang sampling fields are refused (not ignored),
# so a caller never believes a constraint was applied when it was not.
SAMPLING_FIELDS = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "max_new_tokens": (int,),
    "min_new_tokens": (int,), "stop_token_ids": (list, type(None)), "ignore_eos": (bool,),
    "sampling_seed": (int, type(None)), "skip_special_tokens": (bool,), "no_stop_trim": (bool,),
}
SEED_LIMIT = 2**64   # torch.Generator.manual_seed takes an unsigned 64-bit seed
REQUEST_FIELDS = {
    "input_ids", "sampling_params", "return_logprob", "return_routed_experts",
    "routed_experts_start_len", "rid", "stream", "logprob_start_len", "return_text_in_logprobs",
}
# GenerateReqInput fields that SGLang's load balancer (sglang-router 0.3.2, Rust) adds to every
# request it forwards, with the values that ask for nothing: accepted at exactly those values
# (logging switches at any value), refused otherwise like any other unsupported field.
NEUTRAL_FIELDS = {
    "model": (None,), "log_metrics": (True, False), "no_logs": (True, False),
    "return_hidden_states": (False,), "background": (False,), "return_bytes": (False,),
    "return_entropy": (False,),
}


class BadRequest(ValueError):
    """The request breaks the wire format; the message says which field and why (HTTP 400)."""


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling: Sampling
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    rid: str | None = None


def _is(value: Any, types: tuple) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a number
    return isinstance(value, types)


def parse_sampling(sp: Any, vocab_size: int) -> Sampling:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    for k, v in sp.items():
        if k not in SAMPLING_FIELDS:
            raise BadRequest(f"sampling_params.{k}: not supported by this engine "
                             f"(supported: {', '.join(sorted(SAMPLING_FIELDS))})")
        if not _is(v, SAMPLING_FIELDS[k]):
            raise BadRequest(f"sampling_params.{k}: expected {'/'.join(t.__name__ for t in SAMPLING_FIELDS[k])}, "
                             f"got {v!r}")
    s = Sampling(**{k: v for k, v in sp.items() if k in Sampling.__dataclass_fields__})
    s.stop_token_ids = list(s.stop_token_ids or [])
    for k in ("temperature", "top_p"):   # NaN passes every comparison below
        try:
            v = float(getattr(s, k))
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise BadRequest(f"sampling_params.{k} must be a finite number, got {v!r}")
        setattr(s, k, v)
    if s.sampling_seed is not None and not 0 <= s.sampling_seed < SEED_LIMIT:
        raise BadRequest(f"sampling_params.sampling_seed must be in [0, 2**64), got {s.sampling_seed}")
    if s.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be non-negative, got {s.temperature}")
    if not 0.0 < s.top_p <= 1.0:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {s.top_p}")
    if s.top_k != -1 and s.top_k < 1:
        raise BadRequest(f"sampling_params.top_k must be -1 (disable) or at least 1, got {s.top_k}")
    if s.max_new_tokens < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be at least 0, got {s.max_new_tokens}")
    if not 0 <= s.min_new_tokens <= s.max_new_tokens:
        raise BadRequest(f"sampling_params.min_new_tokens must be in [0, max_new_tokens], got {s.min_new_tokens}")
    for t in s.stop_token_ids:
        if not _is(t, (int,)) or not 0 <= t < vocab_size:
            raise BadRequest(f"sampling_params.stop_token_ids: {t!r} is not a token id in [0, {vocab_size})")
    return s


def parse_rid(rid: Any, batch: int | None) -> str | list[str] | None:
    """``rid``: a string (a batch's rows get ``{rid}-{i}``), or for a batch of ``batch`` rows a
    list of exactly that many strings; None or absent: ids are made up."""
    if rid is None or isinstance(rid, str):
        return rid
    if not isinstance(rid, list):
        raise BadRequest(f"rid: expected a string{' or a list of strings' if batch else ''}, "
                         f"got {type(rid).__name__}")
    if batch is None:
        raise BadRequest("rid: a list of ids is for a batch (input_ids a list of lists); "
                         "send one string for one sequence")
    if len(rid) != batch:
        raise BadRequest(f"rid: {len(rid)} ids for {batch} sequences; send one string per sequence")
    for i, r in enumerate(rid):
        if not isinstance(r, str):
            raise BadRequest(f"rid[{i}]: expected a string, got {type(r).__name__}")
    return rid


def parse_object(body: Any, endpoint: str, fields: dict[str, tuple]) -> dict:
    """A control endpoint's body: a JSON object (empty = ``{}``) whose known ``fields`` have
    one of the listed types; unknown fields are ignored, as SGLang's pydantic models do."""
    if not isinstance(body, dict):
        raise BadRequest(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}")
    for k, types in fields.items():
        if k in body and not _is(body[k], types):
            raise BadRequest(f"{endpoint}: {k}: expected {'/'.join(t.__name__ for t in types)}, "
                             f"got {type(body[k]).__name__}")
    return body


def parse_generate(body: Any, vocab_size: int) -> list[GenerateRequest]:
    """Validate a ``/generate`` body; returns one request (or several for a batch body)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(k for k in set(body) - REQUEST_FIELDS
                     if not any(body[k] is v for v in NEUTRAL_FIELDS.get(k, ())))   # None/True/False: identity
    if unknown:
        hint = "; send token ids in input_ids (this engine has no tokenizer)" if "text" in unknown else ""
        raise BadRequest(f"unknown or unsupported field(s): {', '.join(unknown)}{hint}")
    if body.get("stream"):
        raise BadRequest("stream: streaming is not supported by this engine; send stream=false")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids")
    batch = isinstance(ids[0], list)
    seqs = ids if batch else [ids]
    sps = body.get("sampling_params")
    if batch and isinstance(sps, list):
        if len(sps) != len(seqs):
            raise BadRequest(f"sampling_params: {len(sps)} entries for {len(seqs)} sequences")
    else:
        sps = [sps] * len(seqs)
    flags = {}
    for k in ("return_logprob", "return_routed_experts"):
        v = body.get(k, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise BadRequest(f"{k}: expected true or false, got {v!r}")
        flags[k] = v
    start = body.get("routed_experts_start_len", 0)
    start = 0 if start is None else start
    if not _is(start, (int,)):
        raise BadRequest(f"routed_experts_start_len: expected an integer, got {start!r}")
    rid = parse_rid(body.get("rid"), len(seqs) if batch else None)
    out = []
    for i, (seq, sp) in enumerate(zip(seqs, sps)):
        where = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(seq, list) or not seq:
            raise BadRequest(f"{where} must be a non-empty list of token ids")
        for t in seq:
            if not _is(t, (int,)) or not 0 <= t < vocab_size:
                raise BadRequest(f"{where}: {t!r} is not a token id in [0, {vocab_size})")
        if not 0 <= start <= len(seq):
            raise BadRequest(f"routed_experts_start_len={start} is out of range [0, {len(seq)}] "
                             f"(prompt_tokens={len(seq)})")
        r = rid[i] if isinstance(rid, list) else (f"{rid}-{i}" if batch and rid else rid)
        out.append(GenerateRequest(input_ids=list(seq), sampling=parse_sampling(sp, vocab_size),
                                   return_logprob=flags["return_logprob"],
                                   return_routed_experts=flags["return_routed_experts"],
                                   routed_experts_start_len=start, rid=r))
    return out


# --------------------------------------------------------------------------------------
# routed experts payload

# meta_info.routed_experts_dtype (SGLang's SGLANG_ROUTED_EXPERTS_DTYPE) -> little-endian numpy dtype;
# absent = int32 (what servers without the setting send)
ROUTE_DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}


def route_dtype(meta: dict) -> str:
    """The wire dtype of ``meta_info.routed_experts`` (``int32`` when not advertised)."""
    name = meta.get("routed_experts_dtype") or "int32"
    if name not in ROUTE_DTYPES:
        raise ValueError(f"meta_info.routed_experts_dtype={name!r} is not one of {', '.join(ROUTE_DTYPES)}")
    return name


def encode_routes(routes: np.ndarray, dtype: str = "int32") -> str:
    """``[rows, layers, top_k]`` ints -> base64 of little-endian ``dtype`` (SGLang's encoding)."""
    arr = np.asarray(routes)
    if dtype != "int32" and arr.size and (arr.min() < 0 or arr.max() > np.iinfo(ROUTE_DTYPES[dtype]).max):
        raise ValueError(f"expert ids out of range for routed_experts_dtype={dtype}")
    return base64.b64encode(np.ascontiguousarray(arr, dtype=ROUTE_DTYPES[dtype]).tobytes()).decode("ascii")


def decode_routes(payload: str, rows: int, num_layers: int, top_k: int, dtype: str = "int32") -> np.ndarray:
    """Inverse of :func:`encode_routes` (int32 out), checking the byte length against the expected shape."""
    raw = base64.b64decode(payload.encode("ascii") if isinstance(payload, str) else payload)
    item = np.dtype(ROUTE_DTYPES[dtype]).itemsize
    want = rows * num_layers * top_k * item
    if len(raw) != want:
        raise ValueError(f"meta_info.routed_experts has {len(raw)} bytes; expected {want} "
                         f"= {rows} rows x {num_layers} layers x top_k {top_k} x {item} ({dtype}). "
                         f"Does the client's num_moe_layers/top_k (and routed_experts_dtype) match the served model?")
    return np.frombuffer(raw, dtype=ROUTE_DTYPES[dtype]).astype(np.int32).reshape(rows, num_layers, top_k)


def routed_rows(prompt_tokens: int, completion_tokens: int, start: int) -> int:
    """Rows covered by ``routed_experts``: positions ``[start, seqlen - 1)``."""
    return max(0, prompt_tokens + completion_tokens - 1 - start)
