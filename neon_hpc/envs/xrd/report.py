"""The XRD agent evaluation's report (``neon-hpc xrd eval --endpoint``, :mod:`.eval_cli`): success
rate with a 95% interval, phase F1, weight MAE, cost per solve.

Pure arithmetic over per-episode records (dicts), so it is tested on plain numbers.  A record
has: ``success`` (0/1), ``dense``, ``turns``, ``tokens`` (total), ``gen_tokens``,
``phase_f1`` and ``weight_mae`` (None when the grader could not say), ``error`` (str or None),
and optionally ``judge`` (panel verdict, 0/1).
"""

from __future__ import annotations

from typing import Iterable

from neon_hpc.envs.xrd.science.evaluate import wilson_interval  # one interval for both reports


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(records: list[dict]) -> dict:
    n = len(records)
    wins = sum(int(r.get("success", 0) >= 0.5) for r in records)
    lo, hi = wilson_interval(wins, n)
    tokens = sum(int(r.get("tokens", 0)) for r in records)
    out = {
        "episodes": n, "successes": wins, "success_rate": wins / n if n else 0.0,
        "success_ci95": [lo, hi],
        "dense_mean": _mean(r.get("dense") for r in records),
        "phase_f1": _mean(r.get("phase_f1") for r in records),
        "weight_mae": _mean(r.get("weight_mae") for r in records),
        "turns_mean": _mean(r.get("turns") for r in records),
        "tokens_mean": _mean(r.get("tokens") for r in records),
        "gen_tokens_mean": _mean(r.get("gen_tokens") for r in records),
        "tokens_per_solve": tokens / wins if wins else None,
        "errors": sum(1 for r in records if r.get("error")),
        "tool_calls_mean": _mean(r.get("tool_calls") for r in records),
        "tool_errors": sum(int(r.get("tool_errors", 0)) for r in records),
        "malformed_calls": sum(int(r.get("malformed_calls", 0)) for r in records),
    }
    judged = [r for r in records if r.get("judge") is not None]
    if judged:
        agree = sum(int(bool(r["judge"]) == (r.get("success", 0) >= 0.5)) for r in judged)
        out["judge_success_rate"] = sum(int(bool(r["judge"])) for r in judged) / len(judged)
        out["judge_agreement"] = agree / len(judged)
    return out


def _fmt(x, pct: bool = False) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def markdown_table(summaries: dict[str, dict]) -> str:
    """One row per split: the short table a reader pastes into a report."""
    head = ("| split | n | success | 95% CI | phase F1 | weight MAE | turns | tokens | tokens/solve | errors |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for split, s in summaries.items():
        lo, hi = s["success_ci95"]
        rows.append(f"| {split} | {s['episodes']} | {_fmt(s['success_rate'], True)} | "
                    f"{_fmt(lo, True)}-{_fmt(hi, True)} | {_fmt(s['phase_f1'])} | {_fmt(s['weight_mae'])} | "
                    f"{_fmt(s['turns_mean'])} | {_fmt(s['tokens_mean'])} | {_fmt(s['tokens_per_solve'])} | "
                    f"{s['errors']} |")
    if any("judge_agreement" in s for s in summaries.values()):
        rows.append("")
        rows.append("| split | judge success | judge agreement with grader |")
        rows.append("|---|---|---|")
        for split, s in summaries.items():
            if "judge_agreement" in s:
                rows.append(f"| {split} | {_fmt(s['judge_success_rate'], True)} | "
                            f"{_fmt(s['judge_agreement'], True)} |")
    return "\n".join(rows) + "\n"
