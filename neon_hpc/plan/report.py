"""Policies side by side, the sweep over node splits, the recommendation, table and PNG."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from neon_hpc.plan.memory import ActivationTerm, CandidateLayout, layout_search
from neon_hpc.plan.params import Sourced
from neon_hpc.plan.sim import SimResult, simulate
from neon_hpc.plan.steptime import RATIO_BATCH, StepTimeModel
from neon_hpc.plan.workload import sample_episodes

Progress = Callable[[str], None]

# the split hill-climb's first stride, in searchable splits (halved down to 1: see sweep)
HILL_STRIDE = 4


@dataclass
class Variant:
    label: str
    changes: dict
    result: SimResult | None = None


def policy_variants(sourced: Sourced) -> list[Variant]:
    """sync, one-step-off and async as configured; async with the other replay mode and the
    other balancing, so each choice's effect is one row apart."""
    p = sourced.params
    replay = p.replay_mode if p.replay_mode != "off" else "delta"
    other_replay = "full" if replay == "delta" else "delta"
    other_method = "tokenkk" if p.balance_method == "cost" else "cost"
    out = [
        Variant(f"sync {replay} {p.balance_method}", dict(policy="sync", replay_mode=replay)),
        Variant(f"one_step_off {replay} {p.balance_method}", dict(policy="one_step_off", replay_mode=replay)),
        Variant(f"async S={p.max_staleness} {replay} {p.balance_method}", dict(policy="async", replay_mode=replay)),
        Variant(f"async S={p.max_staleness} {other_replay} {p.balance_method}",
                dict(policy="async", replay_mode=other_replay)),
        Variant(f"async S={p.max_staleness} {replay} {other_method}",
                dict(policy="async", replay_mode=replay, balance_method=other_method)),
    ]
    if p.slot_mode == "worker" and not p.queued:   # (abort_stale is not modelled with the engines' queue)
        out.append(Variant(f"async S={p.max_staleness} {replay} {p.balance_method} abort-stale",
                           dict(policy="async", replay_mode=replay, abort_stale=not p.abort_stale)))
        if p.abort_stale:
            out[-1].label = out[-1].label.replace("abort-stale", "no-abort")
    return out


def compare_policies(sourced: Sourced, steps: int | None = None, progress: Progress | None = None) -> list[Variant]:
    variants = policy_variants(sourced)
    for v in variants:
        changes = dict(v.changes, steps=steps or sourced.params.steps)
        v.result = simulate(sourced.replace(**changes).params)
        if progress:
            progress(f"  simulated {v.label}: {v.result.steps} steps in {v.result.sim_seconds:.1f} s")
    return variants


# --------------------------------------------------------------------------------------
# sweep over the split of nodes between the rollout and the trainer groups

@dataclass
class SplitPoint:
    rollout_nodes: int
    train_nodes: int
    result: SimResult | None               # None: the trainer layout does not fit (see layout.problem)
    max_staleness: int = 0
    trajectories_per_step: int = 0
    layout: CandidateLayout | None = None
    concurrency: float = 0.0               # searched: episodes in flight / request slots (0 = the config's)
    num_workers: int = 0                   # rollout.num_workers this gives at this split

    @property
    def key(self) -> tuple:
        return self.max_staleness, self.trajectories_per_step, self.concurrency

    @property
    def fits(self) -> bool:
        return self.layout is None or self.layout.fits

    @property
    def label(self) -> str:
        return (f"{self.rollout_nodes} / {self.train_nodes}  S={self.max_staleness} tps={self.trajectories_per_step}"
                f" W={self.num_workers}")


def split_changes(sourced: Sourced, rollout_nodes: int, train_nodes: int, concurrency: float = 0.0) -> dict:
    """Parameters for another split of the same nodes: engines and their request slots scale
    with the rollout group, the workers' episodes in flight with the request slots (the
    config's ratio, rounded down to whole groups in worker mode, so that workers which fill
    the engines do not start queueing) or ``concurrency`` times the request slots (worker
    mode, > 0); trainer FLOP/s scale with the trainer group."""
    p = sourced.params
    gpn = max(p.gpus_per_node, 1)
    scale = rollout_nodes * gpn / max(p.rollout_gpus, 1)
    g = max(p.group_size, 1) if p.slot_mode == "worker" else 1
    engine_slots = int(round(p.engine_slots * scale))
    if concurrency > 0 and p.engine_slots > 0:
        slots = max(g, int(engine_slots * concurrency + 1e-9) // g * g)
    elif p.engine_slots > 0:
        slots = max(g, engine_slots * p.rollout_slots // (p.engine_slots * g) * g)
    else:
        slots = max(g, int(round(p.rollout_slots * scale / g)) * g)
    return dict(rollout_gpus=rollout_nodes * gpn, train_gpus=train_nodes * gpn, rollout_slots=slots,
                num_engines=max(1, int(round(p.num_engines * scale))), engine_slots=engine_slots)


def trainer_layout(p, train_nodes: int) -> CandidateLayout:
    """The config's TP/PP on ``train_nodes`` (CP, EP, DP re-derived; a deeper pipeline when the
    config's does not divide or fit, see :func:`neon_hpc.plan.memory.layout_search`) and its
    memory verdict."""
    return layout_search(train_nodes * max(p.gpus_per_node, 1), max(p.tp, 1), max(p.pp, 1), max(p.cp, 1),
                         max(p.ep, 1), p.dense_params, p.expert_params, p.gpu_memory_bytes,
                         p.train_memory_fraction, p.num_experts, p.num_layers, activation_term(p))


def activation_term(p) -> ActivationTerm | None:
    """The activation term of the simulator's parameters (None when they carry no model shape)."""
    if not p.hidden_size:
        return None
    return ActivationTerm(hidden=p.hidden_size, heads=p.num_attention_heads, vocab=p.vocab_size,
                          num_layers=max(p.num_layers, 1), token_cap=p.token_cap, recompute=p.recompute,
                          per_hidden=p.act_per_hidden, per_head=p.act_per_head, per_vocab=p.act_per_vocab,
                          element_bytes=p.act_element_bytes)


def split_candidates(total_nodes: int, points: int, train_multiple: int = 1) -> list[int]:
    """Rollout node counts from 10% to 90% of the nodes, ``points`` of them, each leaving the
    trainer a multiple of ``train_multiple`` nodes (whole TP x PP model replicas)."""
    lo, hi = max(1, round(0.1 * total_nodes)), min(total_nodes - 1, round(0.9 * total_nodes))
    if hi < lo:
        return [max(1, total_nodes // 2)]
    m = max(train_multiple, 1)
    valid = [r for r in range(lo, hi + 1) if (total_nodes - r) % m == 0] or list(range(lo, hi + 1))
    n = min(points, len(valid))
    return sorted({valid[int(round(i * (len(valid) - 1) / max(n - 1, 1)))] for i in range(n)})


def search_space(p, target_staleness: int, bounds: list[int] | None = None,
                 tps: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Staleness bounds (the config's up to ``target_staleness``) and trajectories per step
    (half, the config's, 2x, 4x and 8x, in whole groups) to search beside the split."""
    S = p.max_staleness
    if not bounds:
        top = max(S, target_staleness)
        bounds = sorted({S, (S + top) // 2, top})
    g = max(p.group_size, 1)
    if not tps:
        t = p.trajectories_per_step
        tps = sorted({max(g, (t // 2) // g * g), t, 2 * t, 4 * t, 8 * t})
    return sorted(set(bounds)), sorted(set(tps))


def concurrency_space(p, given_pct: list[int] | None = None) -> list[float]:
    """Rollout concurrencies to search (episodes in flight / the engines' request slots; 0 = the
    config's ratio, listed first): worker mode with engine slots only, the config's and 1, 2, 3, 4 (a
    worker holds its group's slots until its slowest episode ends, so filling the request slots
    takes more than 1); ``given_pct`` = ``plan.sweep_in_flight_pct`` (percent) instead."""
    if p.slot_mode != "worker" or p.engine_slots <= 0:
        return [0.0]
    own = p.rollout_slots / p.engine_slots
    if given_pct:
        bad = [c for c in given_pct if not c > 0]
        if bad:
            raise ValueError(f"plan.sweep_in_flight_pct: {bad} -- each value is rollout.num_workers x group_size "
                             f"over the decoding engines x max_batch_size, in percent, and must be > 0")
        return [0.0] + sorted({c / 100.0 for c in given_pct} - {own})
    return [0.0] + sorted({1.0, 2.0, 3.0, 4.0} - {own})


def simulate_point(sourced: Sourced, r_nodes: int, t_nodes: int, S: int, tps: int, steps: int,
                   ratios: dict | None = None, concurrency: float = 0.0) -> SplitPoint:
    """One layout: ``r_nodes`` / ``t_nodes`` (trainer layout re-derived, see :func:`trainer_layout`),
    bound ``S``, ``tps`` trajectories per step, ``concurrency`` x request slots in flight (0 = the
    config's ratio); not simulated when the trainer does not fit."""
    ratios = {} if ratios is None else ratios
    p = sourced.params
    lay = trainer_layout(p, t_nodes)
    changes = split_changes(sourced, r_nodes, t_nodes, concurrency)
    workers = changes["rollout_slots"] // max(p.group_size, 1) if p.slot_mode == "worker" else 0
    if not lay.fits:
        return SplitPoint(r_nodes, t_nodes, None, S, tps, lay, concurrency, workers)
    changes.update(steps=steps, max_staleness=S, trajectories_per_step=tps, policy="async")
    if lay.dp:   # the layout this many trainer nodes give (it decides the step time's cells)
        changes.update(dp=lay.dp, cp=lay.cp, pp=lay.pp)
    q = sourced.replace(**changes).params
    planned = min(tps, RATIO_BATCH)   # the balancer plans at most trainer.RATIO_BATCH sequences (see there),
    key = (q.dp, q.pp, q.cp, planned)  # so batches of that size and more share one ratio
    if key not in ratios:   # one balancer call per layout and planned batch size, on a batch of the workload
        batch = sample_episodes(q, planned, np.random.default_rng(q.seed + 7)).seq_len
        ratios[key] = StepTimeModel(q).planned_ratio(np.asarray(batch, dtype=np.float64))
    res = simulate(q, StepTimeModel(q, ratio=ratios[key]))
    return SplitPoint(r_nodes, t_nodes, res, S, tps, lay, concurrency, workers)


def sweep(sourced: Sourced, points: int, steps: int, target_staleness: int,
          progress: Progress | None = None, bounds: list[int] | None = None,
          tps: list[int] | None = None, in_flight_pct: list[int] | None = None) -> list[SplitPoint]:
    """Search the node split, the staleness bound, trajectories per step and the rollout
    concurrency (async).

    Splits whose trainer layout cannot hold weights, gradients and optimizer state are
    listed, not simulated.  Stage 1: every fitting split at the largest bound and trajectories
    per step, without a queue (the config's concurrency, or 1 when it queues: one event per
    group, cheap); stage 2: every concurrency
    at the best split, then every bound x trajectories-per-step at the best split and
    concurrency; stage 3: hill-climbing the split at the best of those, coarse to fine (splits
    ``HILL_STRIDE`` apart first, the stride halved while the best stays put, then the adjacent
    ones).  The balancer's makespan/bound ratio is computed once per (dp, pp, cp, sequences
    planned: trajectories per step up to ``trainer.RATIO_BATCH``).
    """
    p = sourced.params
    gpn = max(p.gpus_per_node, 1)
    total_nodes = (p.rollout_gpus + p.train_gpus) // gpn
    replica_nodes = math.ceil(max(p.tp, 1) * max(p.pp, 1) / gpn) if p.tp * p.pp > gpn else 1
    Ss, Ts = search_space(p, target_staleness, bounds, tps)
    Cs = concurrency_space(p, in_flight_pct)
    ratios: dict = {}
    out: list[SplitPoint] = []
    done: dict[tuple, SplitPoint] = {}

    def run(r_nodes: int, S: int, t: int, c: float) -> SplitPoint:
        key = (r_nodes, S, t, c)
        if key not in done:
            sp = simulate_point(sourced, r_nodes, total_nodes - r_nodes, S, t, steps, ratios, c)
            done[key] = sp
            out.append(sp)
            if progress:
                what = (f"{sp.result.samples_per_hour:,.0f} samples/h, wasted {sp.result.wasted_tokens_frac:.1%} "
                        f"({sp.result.sim_seconds:.1f} s)" if sp.result else f"does not fit: {sp.layout.problem}")
                progress(f"  split {sp.label}: {what}")
        return done[key]

    splits = split_candidates(total_nodes, points, replica_nodes)
    # no queue in stage 1 (one event per group: cheap): the config's concurrency, or workers that
    # just fill the request slots when the config's queue
    c1 = Cs[0] if Cs == [0.0] or p.rollout_slots <= p.engine_slots else 1.0
    first = [run(r, max(Ss), max(Ts), c1) for r in splits]   # the least wasteful S and tps first
    fitting = [sp for sp in first if sp.result is not None]
    if not fitting:
        return out
    best = _best(fitting)[0]
    for c in Cs:
        run(best.rollout_nodes, max(Ss), max(Ts), c)
    best = _best([sp for sp in out if sp.result is not None])[0]
    for S in Ss:
        for t in Ts:
            run(best.rollout_nodes, S, t, best.concurrency)
    # hill-climb the split at the best S and tps over the splits a trainer can be laid out on: one
    # model replica of trainer nodes at a time, or one node where a deeper pipeline lays that many
    # out (memory.layout_search); coarse to fine: neighbours HILL_STRIDE splits away first, the
    # stride halved whenever the best stays put, down to the adjacent splits
    valid = sorted(set(split_candidates(total_nodes, total_nodes, replica_nodes))
                   | {r for r in split_candidates(total_nodes, total_nodes)
                      if trainer_layout(p, total_nodes - r).fits and trainer_layout(p, total_nodes - r).pp != p.pp})
    stride = max(1, min(HILL_STRIDE, len(valid) // 4))
    for _ in range(4 * len(valid)):
        best = _best([sp for sp in out if sp.result is not None])[0]
        i = valid.index(best.rollout_nodes) if best.rollout_nodes in valid else None
        if i is None:
            break
        for j in (i - stride, i + stride):
            if 0 <= j < len(valid):
                run(valid[j], *best.key)
        if _best([sp for sp in out if sp.result is not None])[0] is best:
            if stride == 1:
                break
            stride //= 2
    return out


def _best(points: list[SplitPoint], max_wasted: float = 0.05) -> tuple[SplitPoint, bool]:
    """Most samples/h among points wasting at most ``max_wasted`` of their rollout tokens
    (True), else the least wasteful (False)."""
    ok = [s for s in points if s.result.wasted_tokens_frac <= max_wasted]
    if ok:
        return max(ok, key=lambda s: s.result.samples_per_hour), True
    return min(points, key=lambda s: (s.result.wasted_tokens_frac, -s.result.samples_per_hour)), False


def recommend(points: list[SplitPoint], target_staleness: int, max_wasted: float = 0.05) -> tuple[SplitPoint, str]:
    """The fitting point with the most trained samples per hour among those wasting at most
    ``max_wasted`` of their rollout tokens (else the least wasteful); every point keeps its
    staleness bound (the simulation masks or drops what would exceed it, and that waste counts)."""
    fitting = [s for s in points if s.result is not None]
    if not fitting:
        raise ValueError("no split of the nodes gives a trainer layout that fits in memory: "
                         + "; ".join(f"{s.train_nodes} trainer nodes: {s.layout.problem}" for s in points[:3]))
    best, within = _best(fitting, max_wasted)
    r = best.result
    why = (f"{'most samples/hour' if within else 'least waste (none within the waste limit)'} at staleness "
           f"<= {best.max_staleness}, wasted rollout tokens <= {max_wasted:.0%}: {r.samples_per_hour:,.0f}/h, "
           f"trainer idle {r.trainer_idle_frac:.0%}, rollout idle {r.rollout_idle_frac:.0%}, wasted "
           f"{r.wasted_tokens_frac:.1%}, token staleness mean {r.token_staleness_mean:.2f} / p95 "
           f"{r.token_staleness_quantile(0.95)}; trainer layout {best.layout.describe() if best.layout else '-'}")
    close = [s for s in fitting
             if s is not best and s.result.wasted_tokens_frac <= max(max_wasted, r.wasted_tokens_frac)
             and s.result.samples_per_hour >= 0.98 * r.samples_per_hour]
    if close:
        why += "; within 2%: " + ", ".join(s.label for s in close)
    return best, why


def not_fitting(points: list[SplitPoint]) -> list[str]:
    seen, out = set(), []
    for s in points:
        if s.result is None and s.train_nodes not in seen:
            seen.add(s.train_nodes)
            out.append(f"{s.rollout_nodes} / {s.train_nodes}: {s.layout.problem}")
    return out


# --------------------------------------------------------------------------------------
# text

COLUMNS = [("time/step s", lambda r: f"{r.time_per_step_s:,.1f}"),
           ("compute s", lambda r: f"{_mean(r.step_compute_s):,.1f}"),
           ("trainer idle", lambda r: f"{r.trainer_idle_frac:.1%}"),
           ("rollout idle", lambda r: f"{r.rollout_idle_frac:.1%}"),
           ("samples/h", lambda r: f"{r.samples_per_hour:,.0f}"),
           ("stale mean", lambda r: f"{r.staleness_mean:.2f}"),
           ("p95", lambda r: f"{r.staleness_quantile(0.95)}"),
           ("max", lambda r: f"{r.staleness_max}"),
           ("dropped", lambda r: f"{r.dropped_frac:.1%}"),
           ("wasted tok", lambda r: f"{r.wasted_tokens_frac:.1%}"),
           ("tok stale mean/p95", lambda r: f"{r.token_staleness_mean:.2f}/{r.token_staleness_quantile(0.95)}"),
           ("versions/traj", lambda r: f"{r.versions_spanned_mean:.2f}"),
           ("engine stall", lambda r: f"{r.engine_stall_mean:.2%}")]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def table(rows: list[tuple[str, SimResult]], first: str = "policy") -> str:
    head = [first] + [c for c, _ in COLUMNS]
    body = [[label] + [f(r) for _, f in COLUMNS] for label, r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def params_table(sourced: Sourced) -> str:
    rows = sourced.table()
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"  {n:<{w0}}  {v:>{w1}}  {s}" for n, v, s in rows)


# --------------------------------------------------------------------------------------
# picture

def write_png(path: str, variants: list[Variant], points: list[SplitPoint] | None = None,
              chosen: SplitPoint | None = None, title: str = "") -> None:
    import matplotlib  # deferred: heavy (matplotlib)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy (matplotlib)

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    labels = [v.label for v in variants]
    res = [v.result for v in variants]
    ax = axes[0][0]
    ax.barh(labels, [r.samples_per_hour for r in res], color="tab:blue")
    ax.set_xlabel("trained samples / hour")
    ax.invert_yaxis()
    ax = axes[0][1]
    ys = range(len(res))
    ax.barh([y - 0.2 for y in ys], [r.trainer_idle_frac for r in res], height=0.4, label="trainer idle")
    ax.barh([y + 0.2 for y in ys], [r.rollout_idle_frac for r in res], height=0.4, label="rollout idle")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("idle fraction")
    ax.legend(loc="lower right")
    ax = axes[1][0]
    for v in variants:
        r = v.result
        if r.staleness and max(r.staleness) > 0:
            ks = sorted(r.staleness)
            total = sum(r.staleness.values())
            ax.plot(ks, [r.staleness[k] / total for k in ks], marker="o", label=v.label)
    ax.set_xlabel("staleness (versions behind the trainer, oldest token)")
    ax.set_ylabel("fraction of trained trajectories")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    if points:
        sim = [s for s in points if s.result is not None]
        keys = sorted({s.key for s in sim})
        cmap = plt.get_cmap("viridis")
        for i, (S, t, c) in enumerate(keys):
            pts = sorted((s for s in sim if s.key == (S, t, c)), key=lambda s: s.rollout_nodes)
            ax.plot([s.rollout_nodes for s in pts], [s.result.samples_per_hour for s in pts], marker="o",
                    color=cmap(i / max(len(keys) - 1, 1)), label=f"S={S} tps={t} x{c:g}" if c else f"S={S} tps={t}")
        bad = [s for s in points if s.result is None]
        if bad:
            ax.plot([s.rollout_nodes for s in bad], [0] * len(bad), "x", color="tab:red", label="trainer does not fit")
        ax.set_xlabel("rollout nodes (rest: trainer)")
        ax.set_ylabel("trained samples / hour")
        if chosen:
            ax.axvline(chosen.rollout_nodes, color="tab:green", linestyle="--", label="recommended")
        ax2 = ax.twinx()
        line = sorted((s for s in sim if chosen is None or s.key == chosen.key), key=lambda s: s.rollout_nodes)
        ax2.plot([s.rollout_nodes for s in line], [s.result.trainer_idle_frac for s in line], ":", color="tab:red",
                 label="trainer idle")
        ax2.plot([s.rollout_nodes for s in line], [s.result.wasted_tokens_frac for s in line], ":",
                 color="tab:orange", label="wasted tokens")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("fraction (recommended S, tps, concurrency)")
        ax.legend(loc="upper left", fontsize=7)
        ax2.legend(loc="upper right", fontsize=7)
    else:
        ax.barh(labels, [r.time_per_step_s for r in res], color="tab:gray")
        ax.invert_yaxis()
        ax.set_xlabel("wall time per trainer step (s)")
    fig.suptitle(title or "neon-hpc plan")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fmt_hours(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def nodes_of(gpus: int, gpn: int) -> int:
    return math.ceil(gpus / max(gpn, 1))
