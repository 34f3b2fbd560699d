"""Episodes and the engine: what one rollout costs in time, tokens and router-export bytes.

An episode is ``turns`` model turns; each turn decodes ``gen`` tokens at the per-request
decode rate, then (except after the last turn) calls a tool (exponential latency) whose
output (``tool_tokens_per_turn``) joins the next prompt.  Turn counts and tokens per turn are
lognormal, capped by ``max_turns`` / ``max_new_tokens`` / ``max_total_tokens``; a
``tail_fraction`` of episodes run ``max_turns`` turns of longer output: the hour-long ones.

Router export (replay): at the end of each turn the engine serialises routed-expert ids,
``full`` = the whole context so far, ``delta`` = only the tokens added since the previous
turn.  While a data-parallel rank serialises, the whole DP group's forward waits (the MoE
all-to-all needs every rank), so an engine is stalled whenever *any* of its ranks exports:
with turn ends arriving at rate ``lam`` and mean export time ``x``, the stalled fraction is
the busy probability of an M/G/inf queue, ``f = 1 - exp(-lam * x)`` (overlapping exports
cost the slowest, not the sum).  Decoding runs at ``(1 - f)`` of its rate.  ``lam`` depends
on how long episodes take, which depends on ``f``: :class:`EngineStall` solves that fixed
point once per occupancy level, so the event simulation only looks it up.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neon_hpc.plan.params import SimParams


@dataclass
class Episodes:
    """A batch of sampled episodes (parallel arrays, one entry per episode)."""

    decode_s: np.ndarray       # pure decode (+ prefill) time at full engine speed
    fixed_s: np.ndarray        # tool latency + this episode's own export time
    seq_len: np.ndarray        # tokens in the finished trajectory (what the trainer sees)
    turns: np.ndarray
    export_s: np.ndarray       # sum over turns of export time (stalls the engine)
    last_turn_frac: np.ndarray  # share of the episode's time in its last turn (for vmax)

    def __len__(self) -> int:
        return len(self.seq_len)


def _segment_cumsum(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Cumulative sum restarting at each episode's first turn."""
    c = np.cumsum(values, dtype=np.float64)
    offset = np.repeat(np.concatenate(([0.0], c[starts[1:] - 1])), np.diff(np.append(starts, len(values))))
    return c - offset


def decode_context_mean(p: SimParams, n: int, rng: np.random.Generator) -> float:
    """Mean context length a decoded token attends to (tokens), weighted by decode tokens: the
    KV cache an engine reads per request and step, on average over its decode time."""
    return sample_episodes(p, n, rng, with_context=True)   # type: ignore[return-value]


def sample_episodes(p: SimParams, n: int, rng: np.random.Generator, with_context: bool = False) -> Episodes:
    if p.episode_seconds:
        return _resample_measured(p, n, rng)
    tail = rng.random(n) < p.tail_fraction
    turns = np.clip(np.rint(rng.lognormal(np.log(p.turns_median), p.turns_sigma, n)), 1, p.max_turns)
    turns = np.where(tail, p.max_turns, turns).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(turns)[:-1]))
    total = int(turns.sum())
    ep_of_turn = np.repeat(np.arange(n), turns)
    med = np.where(tail, p.tail_gen_tokens_median, p.gen_tokens_median)[ep_of_turn]
    gen = np.clip(np.rint(rng.lognormal(np.log(med), p.gen_tokens_sigma, total)), 1, p.max_new_tokens)
    first = np.zeros(total, dtype=bool)
    first[starts] = True
    added = gen + np.where(first, p.prompt_tokens, p.tool_tokens_per_turn)   # tokens new to this turn
    ctx = _segment_cumsum(added, starts)
    keep = (ctx <= p.max_total_tokens) | first          # a cap truncates an episode's later turns
    gen, added, ctx = gen * keep, added * keep, np.where(keep, ctx, 0.0)
    if with_context:   # decode-weighted context: a turn decodes from ctx - gen to ctx
        return float(np.sum(gen * (ctx - gen / 2.0)) / max(float(np.sum(gen)), 1.0))
    turns_kept = np.add.reduceat(keep.astype(np.int64), starts)
    last_kept = starts + turns_kept - 1

    turn_s = gen / p.decode_tokens_per_s
    if p.prefill_tokens_per_s > 0:
        turn_s = turn_s + (added - gen) / p.prefill_tokens_per_s
    turn_s = turn_s * keep
    export_bytes = _export_bytes(p, added, ctx) * keep
    export_s = export_bytes / p.export_bytes_per_s
    tool_calls = np.maximum(turns_kept - 1, 0)
    tool_s = _sum_exponentials(tool_calls, p.tool_latency_s, rng)

    decode_s = np.add.reduceat(turn_s, starts)
    ep_export = np.add.reduceat(export_s, starts)
    seq_len = ctx[last_kept]
    total_s = decode_s + tool_s + ep_export
    last_s = turn_s[last_kept] + export_s[last_kept]
    return Episodes(decode_s=decode_s, fixed_s=tool_s + ep_export, seq_len=seq_len, turns=turns_kept,
                    export_s=ep_export, last_turn_frac=np.divide(last_s, total_s, out=np.ones(n),
                                                                 where=total_s > 0))


def _export_bytes(p: SimParams, added: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    if p.replay_mode == "full":
        return ctx * p.route_bytes_per_token
    if p.replay_mode == "delta":
        return added * p.route_bytes_per_token
    return np.zeros_like(ctx)


def _sum_exponentials(counts: np.ndarray, mean: float, rng: np.random.Generator) -> np.ndarray:
    """Sum of ``counts[i]`` exponential draws each: a gamma draw (shape 0 -> 0)."""
    out = np.zeros(len(counts))
    nz = counts > 0
    out[nz] = rng.gamma(counts[nz], mean)
    return out


def _resample_measured(p: SimParams, n: int, rng: np.random.Generator) -> Episodes:
    """Episodes drawn from a measured run: its episode durations (which already include the
    engine's batching and any export stall) and trajectory lengths, resampled together."""
    idx = rng.integers(0, len(p.episode_seconds), n)
    secs = np.asarray(p.episode_seconds, dtype=np.float64)[idx]
    toks = (np.asarray(p.episode_tokens, dtype=np.float64)[idx] if p.episode_tokens
            else np.full(n, float(p.prompt_tokens)))
    zeros = np.zeros(n)
    # no turn structure: take the version at the episode's midpoint as its newest (a token-mean estimate)
    return Episodes(decode_s=zeros, fixed_s=secs, seq_len=toks, turns=np.ones(n, dtype=np.int64),
                    export_s=zeros, last_turn_frac=np.full(n, 0.5))


class EngineStall:
    """Stalled fraction of an engine as a function of rollout occupancy (0..1 of slots busy)."""

    LEVELS = 101

    def __init__(self, p: SimParams, rng: np.random.Generator, sample: int = 20000):
        ep = sample_episodes(p, sample, rng)
        mean_decode = float(ep.decode_s.mean())
        mean_fixed = float(ep.fixed_s.mean())
        mean_export = float(ep.export_s.mean())
        per_engine = p.request_slots / max(p.num_engines, 1)
        table = np.zeros(self.LEVELS)
        for i, u in enumerate(np.linspace(0.0, 1.0, self.LEVELS)):
            table[i] = self._fixed_point(u * per_engine, mean_decode, mean_fixed, mean_export)
        self.table = table
        self.table_list = table.tolist()

    @staticmethod
    def _fixed_point(busy_slots: float, decode: float, fixed: float, export: float) -> float:
        if busy_slots <= 0 or export <= 0:
            return 0.0
        f = 0.0
        for _ in range(200):
            duration = decode / (1.0 - f) + fixed
            new = 1.0 - np.exp(-busy_slots * export / duration)
            if abs(new - f) < 1e-10:
                break
            f = min(new, 0.999)
        return float(f)

    def fraction(self, occupancy: float) -> float:
        return self.table_list[min(int(occupancy * (self.LEVELS - 1) + 0.5), self.LEVELS - 1)]

    @property
    def at_full(self) -> float:
        return float(self.table[-1])
