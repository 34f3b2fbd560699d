"""The rollout side of router replay: one :class:`ReplayConversation` per episode.

It wraps any engine client with SGLang's ``generate(input_ids, sampling_params,
return_logprob, return_routed_experts, routed_experts_start_len)`` (our
``neon_hpc.rollout.engines.client.EngineClient``), asks each turn for the routes it does not
have yet, splices them into its :class:`~neon_hpc.replay.cache.RouteCache`, and takes the
documented fallbacks (full export) when something does not fit.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Literal, Sequence

import numpy as np

from neon_hpc.replay.cache import ReplayStats, RouteCache, RouteMismatch
from neon_hpc.util.httpretry import RetryPolicy, is_transient

ReplayMode = Literal["delta", "full", "off"]


class ReplayConversation:
    """Generate the turns of one conversation and keep its routed experts.

    ``mode``: ``delta`` (ask only the newest rows), ``full`` (ask everything every turn: the
    baseline) or ``off`` (no routes).  ``max_retries`` bounds retries of one turn after a
    dropped response (transient by :func:`neon_hpc.util.httpretry.is_transient`) or a row mismatch;
    each retry resamples the turn with a full export, after the delay of the project's one
    :class:`~neon_hpc.util.httpretry.RetryPolicy` (exponential from ``backoff_s``, Retry-After honoured).
    """

    def __init__(self, client: Any, mode: ReplayMode = "delta", max_retries: int = 2,
                 version_of: Callable[[str], int] = int, backoff_s: float = 0.2):
        if mode not in ("delta", "full", "off"):
            raise ValueError(f"replay mode must be 'delta', 'full' or 'off', got {mode!r}")
        self.client, self.mode = client, mode
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.policy = RetryPolicy(retries=max_retries, backoff_s=backoff_s)
        self.version_of = version_of
        self.cache = RouteCache("full" if mode == "full" else "delta")
        self.retries = 0
        self.last_start = 0          # routed_experts_start_len of the last successful request

    @property
    def stats(self) -> ReplayStats:
        return self.cache.stats

    def generate(self, input_ids: Sequence[int], sampling_params: dict) -> Any:
        """One turn: returns the engine's result; its routes are already in the cache."""
        input_ids = list(input_ids)
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                time.sleep(self.policy.delay(attempt, last))
            start = self.cache.start_len(input_ids) if self.mode != "off" else 0
            try:
                res = self.client.generate(input_ids, sampling_params, return_logprob=True,
                                           return_routed_experts=self.mode != "off",
                                           routed_experts_start_len=start or None)
            except ValueError as e:   # the payload did not decode (e.g. byte count != rows)
                last = e
                if self.mode == "off":
                    raise
                self.cache.invalidate("row_mismatch")
                continue
            except Exception as e:  # noqa: BLE001 - classified right below
                if not is_transient(e):
                    raise
                last = e
                if self.mode != "off":
                    self.cache.invalidate("dropped")
                continue
            if getattr(res, "aborted", False):   # paused with mode=abort: resample the turn
                last = RuntimeError(f"request aborted: {res.finish_reason}")
                if self.mode != "off":
                    self.cache.invalidate("dropped")
                continue
            if self.mode == "off":
                return res
            try:
                rows = (res.route_row_versions(start, self.version_of) if hasattr(res, "route_row_versions")
                        else self.version_of(res.weight_version))   # per row when the engine sent spans
                self.cache.absorb(input_ids, res.output_ids, res.routed_experts, start, rows)
            except RouteMismatch as e:
                last = e
                self.cache.invalidate("row_mismatch")
                continue
            self.last_start = start
            return res
        raise RuntimeError(f"turn failed after {self.max_retries + 1} attempts: {last}") from last

    def routed_experts(self, n_tokens: int) -> np.ndarray | None:
        """Routes aligned with the first ``n_tokens`` tokens of the conversation (None when off)."""
        if self.mode == "off" or self.cache.routed_experts is None:
            return None
        return self.cache.assembled(n_tokens)
