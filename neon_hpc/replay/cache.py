"""Per-conversation route cache: which slice to ask for, and how to splice the answer in.

Pure bookkeeping on token ids and arrays; no I/O (the client wrapper in ``client.py`` does
the HTTP).  Semantics (SGLang's): a response to a request with ``routed_experts_start_len
= s`` covers positions ``[s, seqlen - 1)`` where ``seqlen = prompt + output`` tokens.  Row
``i`` of the cache holds the experts token ``i`` was routed to when it was forwarded; the
last token of a turn was never forwarded, so its row is a placeholder (a copy of the row
before it, so that replay never indexes an invalid expert) until the next turn's response
overwrites it.  Hence the next request asks from ``prev_seqlen - 1``.

Fallbacks (each counted in :attr:`RouteCache.fallbacks`; a fallback is a full export,
``start = 0``, that rebuilds the whole cache):

- ``prefix_mismatch``: the new prompt does not start with the cached tokens;
- ``row_mismatch``: a response's row count or shape disagrees with the request;
- ``version_change``: a response's weight version differs from the cached rows'.  Policy
  *refresh*: the rows keep their version tags now, and the next request is a full export,
  so the conversation's routes come from one weight version again (a recompute after a
  weight update produces new prefix routes; mixed rows describe no forward pass).  Rows of
  the final turn cannot be refreshed without another request; their tags say so;
- ``dropped``: a request failed in transit; its retry is a full export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

FALLBACK_REASONS = ("prefix_mismatch", "row_mismatch", "version_change", "dropped")


class RouteMismatch(ValueError):
    """A response's routed experts do not fit the request (rows or shape)."""


@dataclass
class ReplayStats:
    """Counters of one conversation (sum them over conversations for a worker's metrics)."""

    requests: int = 0
    delta_requests: int = 0           # start > 0
    full_requests: int = 0            # start == 0 (first turn, full mode, fallbacks)
    rows_received: int = 0
    route_bytes: int = 0              # int32 payload bytes received (the wire adds base64's 4/3)
    fallbacks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FALLBACK_REASONS, 0))

    def add(self, other: "ReplayStats") -> None:
        self.requests += other.requests
        self.delta_requests += other.delta_requests
        self.full_requests += other.full_requests
        self.rows_received += other.rows_received
        self.route_bytes += other.route_bytes
        for k, v in other.fallbacks.items():
            self.fallbacks[k] = self.fallbacks.get(k, 0) + v

    def as_dict(self) -> dict:
        return {"requests": self.requests, "delta_requests": self.delta_requests,
                "full_requests": self.full_requests, "rows_received": self.rows_received,
                "route_bytes": self.route_bytes, "fallbacks": dict(self.fallbacks)}


class RouteCache:
    """Routes of one conversation, assembled from the responses of its turns."""

    def __init__(self, mode: Literal["delta", "full"] = "delta"):
        if mode not in ("delta", "full"):
            raise ValueError(f"replay mode must be 'delta' or 'full', got {mode!r}")
        self.mode = mode
        self.tokens = np.zeros(0, dtype=np.int64)
        self.routed_experts: np.ndarray | None = None          # [rows, layers, top_k] int32
        self.row_versions = np.zeros(0, dtype=np.int64)
        self.stats = ReplayStats()
        self._force_full = False
        # rows [0, pinned) are kept as they are: a resumed episode's routes, received before it was
        # saved (neon_hpc/rollout/journal.py); a later response never overwrites them
        self.pinned = 0

    @property
    def fallbacks(self) -> dict[str, int]:
        return self.stats.fallbacks

    # --- the next request --------------------------------------------------------------
    def start_len(self, prompt_ids: Sequence[int]) -> int:
        """The ``routed_experts_start_len`` to request for this prompt (0 = full export)."""
        n = len(self.tokens)
        if self.mode == "full" or n == 0 or self._force_full:
            return 0
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        if len(prompt) < n or not np.array_equal(prompt[:n], self.tokens):
            self.invalidate("prefix_mismatch")
            return 0
        return n - 1

    def invalidate(self, reason: str) -> None:
        """Count a fallback; the next :meth:`start_len` returns a full export."""
        if reason not in FALLBACK_REASONS:
            raise ValueError(f"unknown fallback reason {reason!r}; one of {FALLBACK_REASONS}")
        self.stats.fallbacks[reason] += 1
        self._force_full = True

    # --- absorbing a response ----------------------------------------------------------
    def absorb(self, prompt_ids: Sequence[int], output_ids: Sequence[int], routed_experts: np.ndarray | None,
               start: int, version) -> None:
        """Splice a response's routes (covering ``[start, seqlen-1)``) into the cache.

        ``version``: the weight version of the new rows ``[start, seqlen)``, one int or one
        per row (a weight update inside the response: rows follow its version spans).

        Raises :class:`RouteMismatch` (cache unchanged) when the rows do not fit; the caller
        then invalidates and retries with a full export.
        """
        seqlen = len(prompt_ids) + len(output_ids)
        routed_experts = self._check(routed_experts, start, seqlen)
        self._count(start, routed_experts)
        vers = np.broadcast_to(np.asarray(version, dtype=np.int64), (seqlen - start,))
        if start > self.pinned and len(vers) and \
                np.any(self.row_versions[self.pinned:start] != vers[0]):   # vs the prefill's version
            self.invalidate("version_change")   # refresh policy: next request is a full export
        else:
            self._force_full = False
        old_routed_experts, old_versions = self.routed_experts, self.row_versions
        head = self.routed_experts[:start] if start > 0 else routed_experts[:0]
        placeholder = routed_experts[-1:] if len(routed_experts) else (head[-1:] if len(head) else
                                                               np.zeros((1,) + routed_experts.shape[1:], np.int32))
        self.routed_experts = np.concatenate([head, routed_experts, placeholder], axis=0)
        self.row_versions = np.concatenate([self.row_versions[:start],
                                            vers])
        if start < self.pinned:     # a full export after a resume: the recorded rows stay
            self.routed_experts[:self.pinned] = old_routed_experts[:self.pinned]
            self.row_versions[:self.pinned] = old_versions[:self.pinned]
        self.tokens = np.concatenate([np.asarray(prompt_ids, np.int64), np.asarray(output_ids, np.int64)])

    def _check(self, routed_experts: np.ndarray | None, start: int, seqlen: int) -> np.ndarray:
        if routed_experts is None:
            raise RouteMismatch("the response carries no routed_experts (was the engine started "
                                "with --enable-return-routed-experts?)")
        routed_experts = np.asarray(routed_experts)
        if routed_experts.ndim != 3:
            raise RouteMismatch(f"routed_experts must be [rows, layers, top_k], got shape {routed_experts.shape}")
        expected = seqlen - 1 - start
        if routed_experts.shape[0] != expected:
            raise RouteMismatch(f"routed_experts has {routed_experts.shape[0]} rows; positions [{start}, {seqlen - 1}) "
                                f"need {expected}")
        if start > 0 and (self.routed_experts is None or start > len(self.routed_experts)):
            cached = 0 if self.routed_experts is None else len(self.routed_experts)
            raise RouteMismatch(f"delta from {start} but only {cached} "
                                f"rows are cached")
        if self.routed_experts is not None and start > 0 and routed_experts.shape[1:] != self.routed_experts.shape[1:]:
            raise RouteMismatch(f"routed_experts rows have shape {routed_experts.shape[1:]}, cached rows "
                                f"{self.routed_experts.shape[1:]}")
        return routed_experts.astype(np.int32, copy=False)

    def _count(self, start: int, routed_experts: np.ndarray) -> None:
        s = self.stats
        s.requests += 1
        if start > 0:
            s.delta_requests += 1
        else:
            s.full_requests += 1
        s.rows_received += int(routed_experts.shape[0])
        s.route_bytes += int(routed_experts.size) * 4

    # --- results -----------------------------------------------------------------------
    def assembled(self, n_tokens: int | None = None) -> np.ndarray:
        """Routes aligned to the conversation's tokens: ``[n, layers, top_k]``; last row a placeholder.

        ``n_tokens`` longer than the cache (tokens appended after the last response, e.g. a
        closing template) are padded with placeholder rows (copies of the last row).
        """
        if self.routed_experts is None:
            raise ValueError("no routes cached yet; absorb a response first")
        n = len(self.routed_experts) if n_tokens is None else n_tokens
        if n <= len(self.routed_experts):
            return self.routed_experts[:n]
        pad = np.repeat(self.routed_experts[-1:], n - len(self.routed_experts), axis=0)
        return np.concatenate([self.routed_experts, pad], axis=0)

    def version_runs(self) -> list[list[int]]:
        """Row versions run-length encoded: ``[[first_row, version], ...]`` (JSON-able)."""
        runs: list[list[int]] = []
        for i, v in enumerate(self.row_versions.tolist()):
            if not runs or runs[-1][1] != v:
                runs.append([i, int(v)])
        return runs
