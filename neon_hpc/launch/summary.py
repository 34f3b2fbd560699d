"""The run summary: what a run did, from its metrics (``metrics/*.jsonl``) and job record."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from neon_hpc.protocol.records import JobRecord
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import read_metrics


def trained_versions_and_waste(trainer: list[dict]) -> dict[str, Any]:
    """From trainer step records: how many versions the trained trajectories span (histogram),
    the share spanning >= 2, and the rollout tokens wasted to staleness (dropped + masked over
    generated, as the claims counted them)."""
    spans: Counter = Counter()
    for r in trainer:
        for k, v in (r.get("version_spans") or {}).items():
            spans[int(k)] += int(v)
    gen = sum(int(r.get("claimed_gen_tokens", 0)) for r in trainer)
    masked = sum(int(r.get("masked_stale_tokens", 0)) for r in trainer)
    dropped = sum(int(r.get("dropped_stale_tokens", 0)) for r in trainer)
    n = sum(spans.values())
    return {"trained_versions_spanned": dict(sorted(spans.items())),
            "trained_multi_version_fraction": sum(v for k, v in spans.items() if k >= 2) / n if n else None,
            "masked_stale_tokens": masked, "dropped_stale_tokens": dropped,
            "wasted_rollout_tokens": (masked + dropped) / gen if gen else None}


def trainer_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One metrics record per step, the last one written: a step that was trained again after a
    resume (its checkpoint was older) appears twice in metrics.jsonl but counts once."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in records:
        by_step[r.get("step")] = r
    return sorted(by_step.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


def summarize(run_dir: str | os.PathLike) -> dict[str, Any]:
    run = RunDir(run_dir)
    trainer = trainer_steps(read_metrics(run.root, "trainer"))
    events = read_metrics(run.root, "rollout")
    rollout = [r for r in events if "event" not in r]
    spans = Counter(int(r["version_max"]) - int(r["version_min"]) + 1 for r in rollout
                    if r.get("version_min", -1) >= 0)
    job = JobRecord.read(run)
    started = job and (job.first_started if job.first_started is not None else job.started)
    times = [r["time"] for r in trainer + rollout]
    wall = (max(times) - min([started] + times if started else times)) if times else 0.0
    wait = sum(r.get("wait_s", 0.0) for r in trainer)
    busy = sum(r.get("step_time_s", 0.0) for r in trainer)
    workers = {r.get("worker") for r in rollout} or {0}
    rollout_wait = sum(r.get("seconds", 0.0) for r in events if r.get("event") in ("admission_wait", "backpressure"))

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    k = max(1, min(3, len(trainer) // 3))
    return {
        "steps": len(trainer),
        "trajectories_written": len(rollout),
        "trajectories_trained": sum(int(r.get("trajectories", 0)) for r in trainer),
        "tokens_written": sum(int(r.get("tokens", 0)) for r in rollout),
        "tokens_trained": sum(int(r.get("tokens", 0)) for r in trainer),
        "versions_spanned": dict(sorted(spans.items())),
        "reward_first": mean([r.get("reward_mean") for r in trainer[:k]]),
        "reward_last": mean([r.get("reward_mean") for r in trainer[-k:]]),
        "reward_steps": k,                      # steps averaged at each end
        "staleness_max": max((r.get("staleness_max", 0) for r in trainer), default=None),
        "trainer_idle_fraction": wait / (wait + busy) if wait + busy > 0 else None,
        "rollout_idle_fraction": rollout_wait / (wall * len(workers)) if wall > 0 else None,
        "wall_s": wall,
        **trained_versions_and_waste(trainer),
        **journal_counts(events),
    }


def journal_counts(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The episode journal across restarts (rollout ``resume`` and ``journal`` events): episodes
    resumed, tokens kept and lost (quarantined records), each restart's counts, and the share of
    rollout time the episodes spent in the journal."""
    resumes = [r for r in events if r.get("event") == "resume"]
    ends = [r for r in events if r.get("event") == "journal"]
    rollout_s = sum(float(r.get("rollout_s", 0.0)) for r in ends)
    return {"resumed_episodes": sum(int(r.get("episodes", 0)) for r in resumes),
            "resumed_tokens_kept": sum(int(r.get("tokens_kept", 0)) for r in resumes),
            "resumed_tokens_lost": sum(int(r.get("tokens_lost", 0)) for r in resumes),
            "resume_quarantined": sum(int(r.get("quarantined", 0)) for r in resumes),
            "turns_dropped_at_stop": sum(int(r.get("turns_dropped", 0)) for r in ends),
            "resumes": [{k: r.get(k) for k in ("time", "worker", "episodes", "tokens_kept", "tokens_lost",
                                                "quarantined")} for r in resumes],
            "journal_overhead": sum(float(r.get("seconds", 0.0)) for r in ends) / rollout_s if rollout_s else None}


def render_summary(s: dict[str, Any]) -> str:
    def f(v):
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
    spans = ", ".join(f"{k} version{'s' if k > 1 else ''}: {v}" for k, v in s["versions_spanned"].items()) or "-"
    trained = ", ".join(f"{k} version{'s' if k > 1 else ''}: {v}"
                        for k, v in s.get("trained_versions_spanned", {}).items()) or "-"
    ends = f" (mean of {s['reward_steps']} steps at each end)" if s.get("reward_steps") else ""
    return "\n".join([
        f"steps {s['steps']}   wall {s['wall_s']:.0f}s",
        f"trajectories written {s['trajectories_written']}, trained {s['trajectories_trained']}; "
        f"tokens written {s['tokens_written']}, trained {s['tokens_trained']}",
        f"versions spanned per trajectory (newest - oldest + 1, as written): {spans}",
        f"versions spanned per trained trajectory (token by token): {trained}   "
        f"(>= 2 versions: {f(s.get('trained_multi_version_fraction'))})",
        f"wasted rollout tokens {f(s.get('wasted_rollout_tokens'))} (stale: {s.get('masked_stale_tokens', 0)} "
        f"masked, {s.get('dropped_stale_tokens', 0)} dropped)",
        f"reward first {f(s['reward_first'])} -> last {f(s['reward_last'])}{ends}   "
        f"max staleness {f(s['staleness_max'])}",
        f"idle fraction: trainer {f(s['trainer_idle_fraction'])}, rollout {f(s['rollout_idle_fraction'])}",
    ] + _journal_lines(s, f) + _eval_lines(s, f))


def _journal_lines(s: dict[str, Any], f) -> list[str]:
    if not s.get("resumes") and s.get("journal_overhead") is None:
        return []
    per = "; ".join(f"worker {r['worker']}: {r['episodes']} episodes, {r['tokens_kept']} tokens kept, "
                    f"{r['tokens_lost']} lost" for r in s.get("resumes", []))
    return [f"journal: {s.get('resumed_episodes', 0)} episodes resumed, {s.get('resumed_tokens_kept', 0)} tokens "
            f"kept, {s.get('resumed_tokens_lost', 0)} lost ({s.get('resume_quarantined', 0)} records quarantined, "
            f"{s.get('turns_dropped_at_stop', 0)} turns in flight dropped at stops)"
            f"{' [' + per + ']' if per else ''}; overhead {f(s.get('journal_overhead'))} of rollout time"]


def _eval_lines(s: dict[str, Any], f) -> list[str]:
    """The warm start and the greedy eval before/after RL (``launch/warm.py``), when the run has them."""
    out = []
    w = s.get("warm_start") or {}
    if w:
        out.append(f"warm start: {(w.get('demos') or {}).get('demos', '-')} demonstrations, SFT loss "
                   f"{f(w.get('sft_loss_first'))} -> {f(w.get('sft_loss_last'))}"
                   f"{' (reused)' if w.get('reused') else ''}; RL from {w.get('checkpoint')}")
    if s.get("eval_success_end") is not None:
        out.append(f"eval success (greedy, {s.get('eval_tasks')} held-out tasks): start of RL "
                   f"{f(s.get('eval_success_start'))} (v_{s.get('eval_version_start')}) -> end "
                   f"{f(s.get('eval_success_end'))} (v_{s.get('eval_version_end')}); dense "
                   f"{f(s.get('eval_dense_start'))} -> {f(s.get('eval_dense_end'))}")
    if s.get("cpu_s_children") is not None:
        out.append(f"CPU time: launcher {s['cpu_s_launcher']:.0f}s, its processes {s['cpu_s_children']:.0f}s")
    return out
