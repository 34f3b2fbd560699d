"""Policies side by side, the sweep over node splits, the recommendation, table and PNG."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from neon_hpc.plan.params import Sourced
from neon_hpc.plan.sim import SimResult, simulate

Progress = Callable[[str], None]


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
    other_planner = "tokenkk" if p.planner == "cost" else "cost"
    out = [
        Variant(f"sync {replay} {p.planner}", dict(policy="sync", replay_mode=replay)),
        Variant(f"one_step_off {replay} {p.planner}", dict(policy="one_step_off", replay_mode=replay)),
        Variant(f"async S={p.max_staleness} {replay} {p.planner}", dict(policy="async", replay_mode=replay)),
        Variant(f"async S={p.max_staleness} {other_replay} {p.planner}",
                dict(policy="async", replay_mode=other_replay)),
        Variant(f"async S={p.max_staleness} {replay} {other_planner}",
                dict(policy="async", replay_mode=replay, planner=other_planner)),
    ]
    if p.slot_mode == "worker":
        out.append(Variant(f"async S={p.max_staleness} {replay} {p.planner} abort-stale",
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
    result: SimResult


def split_changes(sourced: Sourced, rollout_nodes: int, train_nodes: int) -> dict:
    """Parameters for another split of the same nodes: rollout slots and engines scale with
    the rollout group (whole groups in worker mode), trainer FLOP/s with the trainer group."""
    p = sourced.params
    gpn = max(p.gpus_per_node, 1)
    scale = rollout_nodes * gpn / max(p.rollout_gpus, 1)
    g = max(p.group_size, 1) if p.slot_mode == "worker" else 1
    slots = max(g, int(round(p.rollout_slots * scale / g)) * g)
    return dict(rollout_gpus=rollout_nodes * gpn, train_gpus=train_nodes * gpn, rollout_slots=slots,
                num_engines=max(1, int(round(p.num_engines * scale))),
                engine_slots=int(round(p.engine_slots * scale)))


def split_candidates(total_nodes: int, points: int) -> list[int]:
    lo, hi = max(1, round(0.1 * total_nodes)), min(total_nodes - 1, round(0.9 * total_nodes))
    if hi < lo:
        return [max(1, total_nodes // 2)]
    n = min(points, hi - lo + 1)
    return sorted({int(round(lo + i * (hi - lo) / max(n - 1, 1))) for i in range(n)})


def sweep(sourced: Sourced, points: int, steps: int, target_staleness: int,
          progress: Progress | None = None) -> list[SplitPoint]:
    p = sourced.params
    gpn = max(p.gpus_per_node, 1)
    total_nodes = (p.rollout_gpus + p.train_gpus) // gpn
    out = []
    for r_nodes in split_candidates(total_nodes, points):
        changes = split_changes(sourced, r_nodes, total_nodes - r_nodes)
        changes.update(steps=steps, max_staleness=target_staleness)
        res = simulate(sourced.replace(**changes).params)
        out.append(SplitPoint(r_nodes, total_nodes - r_nodes, res))
        if progress:
            progress(f"  split {r_nodes} rollout / {total_nodes - r_nodes} train nodes: "
                     f"{res.samples_per_hour:,.0f} samples/h ({res.sim_seconds:.1f} s)")
    return out


def recommend(points: list[SplitPoint], target_staleness: int) -> tuple[SplitPoint, str]:
    """The split with the most trained samples per hour; every point already keeps the
    staleness bound (the simulation drops what would exceed it, and that waste counts)."""
    best = max(points, key=lambda s: s.result.samples_per_hour)
    close = [s for s in points if s.result.samples_per_hour >= 0.98 * best.result.samples_per_hour]
    why = (f"most samples/hour at staleness <= {target_staleness} "
           f"({best.result.samples_per_hour:,.0f}/h, trainer idle {best.result.trainer_idle_frac:.0%}, "
           f"rollout idle {best.result.rollout_idle_frac:.0%}, dropped {best.result.dropped_frac:.1%})")
    if len(close) > 1:
        why += "; within 2%: " + ", ".join(f"{s.rollout_nodes}/{s.train_nodes}" for s in close if s is not best)
    return best, why


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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        xs = [s.rollout_nodes for s in points]
        ax.plot(xs, [s.result.samples_per_hour for s in points], marker="o", color="tab:blue", label="samples/h")
        ax.set_xlabel("rollout nodes (rest: trainer)")
        ax.set_ylabel("trained samples / hour")
        if chosen:
            ax.axvline(chosen.rollout_nodes, color="tab:green", linestyle="--", label="recommended")
        ax2 = ax.twinx()
        ax2.plot(xs, [s.result.trainer_idle_frac for s in points], color="tab:red", label="trainer idle")
        ax2.plot(xs, [s.result.rollout_idle_frac for s in points], color="tab:orange", label="rollout idle")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("idle fraction")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
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
