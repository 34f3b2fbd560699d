"""``neon-hpc plot RUN [--out PNG]``: reward (and the eval success before/after RL), staleness, throughput
and trainer idle fraction.

One PNG (default ``RUN/plots/run.png``), four panels, from the metrics.jsonl files only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from neon_hpc.protocol.rundir import RunDir, read_json
from neon_hpc.util.logs import read_metrics


def _eval_points(run: RunDir, steps: list) -> list[tuple[float, float, int]]:
    """(trainer step, eval success, tasks) at the start and the end of RL, from ``RUN/eval/{start,end}.json``."""
    out = []
    for which in ("start", "end"):
        e = read_json(run.root / "eval" / f"{which}.json")
        if e and e.get("success") is not None:
            out.append((float(e.get("version", 0)), float(e["success"]), int(e.get("n", 0))))
    return out


def plot_run(run_dir: str, out: str | None = None) -> Path:
    # matplotlib is imported where used: the light CLI imports this module
    import matplotlib  # deferred: heavy (matplotlib)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy (matplotlib)

    run = RunDir(run_dir)
    trainer = read_metrics(run.root, "trainer")
    rollout = [r for r in read_metrics(run.root, "rollout") if "event" not in r]
    if not trainer and not rollout:
        raise SystemExit(f"neon-hpc plot: no metrics yet in {run.logs}; wait for the first trainer step")
    t0 = min(r["time"] for r in trainer + rollout)
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    steps = [r["step"] for r in trainer]

    a = ax[0][0]
    if trainer:
        a.plot(steps, [r.get("reward_mean", float("nan")) for r in trainer], "o-", label="trainer batch")
    if rollout:
        xs = [(r["time"] - t0) for r in rollout]
        a2 = a.twiny()
        a2.plot(xs, [r.get("reward", float("nan")) for r in rollout], ".", alpha=0.25, color="gray")
        a2.set_xlabel("wall time (s), gray: single trajectories")
    a.set_xlabel("trainer step"); a.set_ylabel("reward"); a.set_title("reward")
    ev = _eval_points(run, steps)
    if ev:   # greedy success on the fixed held-out eval set at the start and the end of RL (launch/warm.py)
        a.plot([x for x, _y, _n in ev], [y for _x, y, _n in ev], "D-", color="tab:red", markersize=8,
               label=f"eval success (greedy, {ev[-1][2]} held-out tasks)")
        for x, y, _n in ev:
            a.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", color="tab:red")
        a.legend(loc="upper left", fontsize=8)

    a = ax[0][1]
    if trainer:
        a.plot(steps, [r.get("staleness_mean", float("nan")) for r in trainer], "o-", label="mean")
        a.plot(steps, [r.get("staleness_max", float("nan")) for r in trainer], "s--", label="max")
        a.legend()
    a.set_xlabel("trainer step"); a.set_ylabel("versions behind"); a.set_title("staleness of consumed tokens")

    a = ax[1][0]
    if trainer:
        a.plot([r["time"] - t0 for r in trainer], [r.get("tokens_per_s", float("nan")) for r in trainer],
               "o-", label="trainer")
    if len(rollout) > 1:
        import numpy as np  # deferred: heavy (numpy)
        # generated tokens per time bin: trajectories finish in bursts, a per-record rate is noise
        ts = np.array([r["time"] - t0 for r in rollout])
        width = max(2.0, float(ts.max()) / 30)
        edges = np.arange(0.0, float(ts.max()) + width, width)
        tok, _ = np.histogram(ts, bins=edges, weights=[r.get("tokens", 0) for r in rollout])
        a.step(edges[:-1], tok / width, where="post", label=f"rollout ({width:.0f}s bins)")
    a.set_xlabel("wall time (s)"); a.set_ylabel("tokens/s"); a.set_title("throughput"); a.legend()

    a = ax[1][1]
    if trainer:
        idle = [r.get("wait_s", 0.0) / max(r.get("wait_s", 0.0) + r.get("step_time_s", 0.0), 1e-9) for r in trainer]
        a.bar(steps, idle)
        a.set_ylim(0, 1)
    a.set_xlabel("trainer step"); a.set_ylabel("fraction of step waiting for data")
    a.set_title("trainer idle fraction")

    fig.suptitle(f"neon-hpc run {run.root.name}")
    fig.tight_layout()
    path = Path(out) if out else run.root / "plots" / "run.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print(plot_run(a.run_dir, a.out))
    return 0
