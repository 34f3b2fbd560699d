"""Evaluation of a solver over task sets: success with a confidence interval, phase F1, fraction MAE."""
from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from neon_hpc.envs.xrd.science import baseline  # baseline.trace looked up per call: tests replace it
from neon_hpc.envs.xrd.science.baseline import THRESHOLD_GRID, solve
from neon_hpc.envs.xrd.science.grader import MAJOR, STRICT_TOL, grade, phase_key
from neon_hpc.envs.xrd.science.library import load_library
from neon_hpc.envs.xrd.science.quant import SE_K, QuantModel, calibrate_se, choose_radius, coverage
from neon_hpc.envs.xrd.science.records import RecordDB
from neon_hpc.envs.xrd.science.tasks import Task, build_record_db, load_tasks, make_context
from neon_hpc.util.progress import bar


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate (sane at 0 and n, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class EvalReport:
    name: str
    n: int = 0
    successes: int = 0
    dense_sum: float = 0.0
    tp: int = 0
    fp: int = 0
    fn: int = 0
    abs_err_sum: float = 0.0
    abs_err_n: int = 0
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)

    def add(self, task: Task, predicted, g, seconds: float, cpu_seconds: float | None = None) -> None:
        """One graded task; ``g`` is the caller's grade, both tolerances are recorded beside it."""
        self.n += 1
        self.successes += int(g.success)
        self.dense_sum += g.dense
        d = g.details
        true_major = [k for k, (_, _, w) in zip(d["abs_errors"], task.truth) if w >= MAJOR]
        found = [k for k in true_major if d["predicted_matched"].get(k, 0) >= MAJOR]
        self.tp += len(found)
        self.fn += len(true_major) - len(found)
        self.fp += len(d["spurious_major"])
        self.abs_err_sum += sum(d["abs_errors"].values())
        self.abs_err_n += len(d["abs_errors"])
        self.seconds += seconds
        strict = g.details["tolerance"] <= STRICT_TOL
        other = grade(predicted, task.truth, strict=not strict)
        s10, s5 = (other.success, g.success) if strict else (g.success, other.success)
        self.rows.append({"task": task.id, "success": g.success, "success_10": s10, "success_5": s5,
                          "dense": round(g.dense, 4), "abs_errors": d["abs_errors"],
                          "predicted": [(p, round(w, 4)) for p, w in predicted],
                          "truth": [(p or f, round(w, 4)) for p, f, w in task.truth], "seconds": round(seconds, 2),
                          **({} if cpu_seconds is None else {"cpu_seconds": round(cpu_seconds, 2)})})

    @staticmethod
    def _strict_block(rows: list[dict]) -> dict:
        """Success at +-10 and +-5 wt% (Wilson 95 %), weight-fraction MAE and seconds per pattern of ``rows``."""
        n = len(rows)
        out = {"n": n}
        for tol in (10, 5):
            k = sum(r[f"success_{tol}"] for r in rows)
            lo, hi = wilson_interval(k, n)
            out[f"success_{tol}"] = round(k / max(1, n), 4)
            out[f"success_{tol}_ci95"] = [round(lo, 4), round(hi, 4)]
        errs = [e for r in rows for e in r["abs_errors"].values()]
        out["wf_mae"] = round(sum(errs) / max(1, len(errs)), 4)
        out["seconds_per_pattern"] = round(sum(r["seconds"] for r in rows) / max(1, n), 2)
        cpu = [r["cpu_seconds"] for r in rows if "cpu_seconds" in r]
        if cpu and len(cpu) == n:
            out["cpu_seconds_per_pattern"] = round(sum(cpu) / n, 2)
        return out

    def summary(self) -> dict:
        lo, hi = wilson_interval(self.successes, self.n)
        f1 = 2 * self.tp / (2 * self.tp + self.fp + self.fn) if self.tp else 0.0
        out = {"name": self.name, "n": self.n, "success": round(self.successes / max(1, self.n), 4),
               "success_ci95": [round(lo, 4), round(hi, 4)], "phase_f1": round(f1, 4),
               "wf_mae": round(self.abs_err_sum / max(1, self.abs_err_n), 4),
               "dense": round(self.dense_sum / max(1, self.n), 4),
               "seconds_per_task": round(self.seconds / max(1, self.n), 2)}
        # the strict report: both tolerances, overall and per scan length (real scans: '...--2min')
        out["strict"] = self._strict_block(self.rows)
        by: dict[str, list[dict]] = {}
        for r in self.rows:
            scan = r["task"].rpartition("--")[2] if "--" in r["task"] else ""
            if scan:
                by.setdefault(scan, []).append(r)
        out["strict"]["by_scan"] = {k: self._strict_block(v) for k, v in sorted(by.items())}
        return out


def strict_lines(summary: dict, indent: str = "  ") -> list[str]:
    """The strict report as text: +-10 / +-5 wt% success, MAE, s/pattern, overall and per scan length."""
    def one(name, b):
        cpu = f", {b['cpu_seconds_per_pattern']} s CPU" if "cpu_seconds_per_pattern" in b else ""
        return (f"{indent}{name:<8} n={b['n']:<3} +-10wt%={b['success_10']:.3f} "
                f"[{b['success_10_ci95'][0]:.3f}, {b['success_10_ci95'][1]:.3f}]  +-5wt%={b['success_5']:.3f} "
                f"[{b['success_5_ci95'][0]:.3f}, {b['success_5_ci95'][1]:.3f}]  wf_MAE={b['wf_mae']:.4f}  "
                f"{b['seconds_per_pattern']} s/pattern{cpu}")
    st = summary["strict"]
    return [one("all", st)] + [one(k, v) for k, v in st.get("by_scan", {}).items()]


def baseline_solver(ctx) -> list[tuple[str, float]]:
    return solve(ctx).phases


SOLVERS: dict[str, Callable] = {"baseline": baseline_solver}


def evaluate(tasks: list[Task], solver: Callable = baseline_solver, name: str = "", strict: bool = False,
             record_db: RecordDB | None = None, progress: Callable[[str], None] | None = None) -> EvalReport:
    record_db = record_db or build_record_db(tasks, ":memory:", include_real=True)
    report = EvalReport(name or (tasks[0].split if tasks else "empty"))
    for i, task in enumerate(bar(tasks, desc=f"eval {report.name}", unit="task")):
        t0, c0 = time.perf_counter(), time.process_time()
        ctx = make_context(task, record_db)
        try:
            predicted = solver(ctx)
        except Exception as e:  # noqa: BLE001 - a crashing solver scores zero on that task, the run goes on
            predicted = []
            if progress:
                progress(f"{task.id}: solver failed: {type(e).__name__}: {e}")
        g = grade(predicted, task.truth, strict=strict)
        report.add(task, predicted, g, time.perf_counter() - t0, time.process_time() - c0)
        if progress:
            progress(f"[{i + 1}/{len(tasks)}] {task.id} success={g.success} dense={g.dense:.3f}")
    return report


def mixture_of(task: Task) -> str:
    """The weighed mixture a real scan belongs to (both scan lengths of one mixture share it)."""
    return task.id.partition("--")[0]


def scan_of(task: Task) -> str:
    return task.id.rpartition("--")[2] if "--" in task.id else ""


def trace_all(tasks: list[Task], record_db: RecordDB | None = None, progress: Callable[[str], None] | None = None):
    """The baseline's refinement trace of every task, with wall and CPU seconds per task (including a
    measured pattern's quantification refit at the default thresholds, :meth:`Trace.quant_fit`)."""
    record_db = record_db or build_record_db(tasks, ":memory:", include_real=True)
    traces, wall, cpu = [], [], []
    for i, task in enumerate(tasks):
        t0, c0 = time.perf_counter(), time.process_time()
        tr = baseline.trace(make_context(task, record_db))
        tr.quant_fit(tr.final_fit()[0])     # a measured pattern's f', f'' refit (default thresholds), timed with it
        traces.append(tr)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if progress:
            progress(f"[{i + 1}/{len(tasks)}] traced {task.id} ({wall[-1]:.1f} s wall, {cpu[-1]:.1f} s CPU, "
                     f"{len(traces[-1].steps)} steps)")
    return traces, wall, cpu


def report_from_traces(tasks: list[Task], traces, thresholds, seconds, name: str, strict: bool = False,
                       cpu=None) -> EvalReport:
    """Score every task at one set of thresholds (no refitting of the search)."""
    rep = EvalReport(name)
    for i, (task, tr, sec) in enumerate(zip(tasks, traces, seconds)):
        sol = tr.decide(thresholds)
        rep.add(task, sol.phases, grade(sol.phases, task.truth, strict=strict), sec,
                None if cpu is None else cpu[i])
    return rep


def loo_folds(tasks: list[Task], traces, grid, strict: bool = False, outcome: dict | None = None) -> dict[str, dict]:
    """Per held-out mixture, the grid point fitted on the *other* mixtures' scans only.

    ``{mixture: {"index": j, "thresholds": grid[j], "held": [task indices], "rest": [task indices],
    "rest_successes": n}}``: j has the most successes over ``rest`` (ties: lower weight-fraction
    MAE, then the earlier grid entry), both from the identification fit (:meth:`Trace.identify`:
    Hill-Howard, no f', f'', no Brindley correction), so that the thresholds do not depend on the
    quantification model fitted after them.  ``outcome`` caches ``(task index, j) -> (phases, Grade)``.
    """
    outcome = {} if outcome is None else outcome

    def result(i: int, j: int):
        if (i, j) not in outcome:
            found = traces[i].identify(grid[j])
            outcome[(i, j)] = (found, grade(found, tasks[i].truth, strict=strict))
        return outcome[(i, j)]

    groups: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        groups.setdefault(mixture_of(t), []).append(i)
    if len(groups) < 2:
        raise ValueError(f"leave one mixture out needs at least 2 mixtures, got {len(groups)} "
                         f"({', '.join(groups) or 'no tasks'})")
    folds = {}
    for mix, held in groups.items():
        rest = [i for i in range(len(tasks)) if i not in held]

        def score(j):
            gs = [result(i, j)[1] for i in rest]
            errs = [e for g in gs for e in g.details["abs_errors"].values()]
            return (sum(g.success for g in gs), -sum(errs) / max(1, len(errs)), -j)
        best = max(range(len(grid)), key=score)
        folds[mix] = {"index": best, "thresholds": grid[best], "held": held, "rest": rest,
                      "rest_successes": score(best)[0]}
    return folds


def true_fractions(task: Task) -> dict[str, float]:
    """The task's true fractions by the grader's labels (library id, or the formula of a formula-only truth)."""
    lib = load_library()
    total = sum(float(w) for _, _, w in task.truth) or 1.0
    out: dict[str, float] = {}
    for pid, formula, w in task.truth:
        label = (phase_key(pid, lib) if pid and pid in lib else phase_key(formula, lib)).label
        out[label] = out.get(label, 0.0) + float(w) / total
    return out


def matched(task: Task, quants) -> list[tuple[float, float, float, float]]:
    """Per true phase (true w, predicted w, se_stat, se), predicted phases matched as the grader matches them.

    Several predicted phases of one formula-only truth (anatase + rutile for "TiO2") add up, their
    standard errors in quadrature.
    """
    g = grade([(q.phase_id, q.weight_fraction) for q in quants], task.truth)
    se_stat2: dict[str, float] = {}
    se2: dict[str, float] = {}
    for q, label in zip(quants, g.details["assignment"]):
        if label is not None:
            se_stat2[label] = se_stat2.get(label, 0.0) + q.se_stat ** 2
            se2[label] = se2.get(label, 0.0) + q.se ** 2
    return [(wt, g.details["predicted_matched"].get(label, 0.0), math.sqrt(se_stat2.get(label, 0.0)),
             math.sqrt(se2.get(label, 0.0))) for label, wt in true_fractions(task).items()]


def choose_quant(tasks: list[Task], fits: dict, indices: list[int], cache: dict | None = None):
    """The :class:`QuantModel` fitted on the scans ``indices`` only: Brindley radius (MAP, prior), then se_sys.

    ``fits``: task index -> (Trace, refined FitResult or None) at the fold's thresholds.  The radius is
    chosen on every scan of ``indices``; se_sys is calibrated on *predictive* errors: each mixture of
    ``indices`` quantified at the radius chosen on the others (a nested leave-one-mixture-out), so that
    it covers the error of a radius chosen without the mixture, as the held-out one's is.  (Calibrated
    on the scans the radius was chosen on, +-2 s.e. held 0.83 of the held-out fractions, not 0.95.)
    """
    cache = {} if cache is None else cache

    def quants_at(i: int, R: float):
        key = (i, id(fits[i][1]), R)
        if key not in cache:
            tr, res = fits[i]
            cache[key] = [] if res is None else tr.quantify(res, QuantModel(radius_um=R, se_sys=0.0))
        return cache[key]

    def at(i, R):
        return {label: wp for label, (_, wp, _, _) in zip(true_fractions(tasks[i]), matched(tasks[i], quants_at(i, R)))}

    def radius_on(idx: list[int]) -> float:
        return choose_radius([(i, true_fractions(tasks[i])) for i in idx], at)

    R = radius_on(indices)
    groups: dict[str, list[int]] = {}
    for i in indices:
        groups.setdefault(mixture_of(tasks[i]), []).append(i)
    pairs, inner = [], {}
    for mix, held in groups.items():
        rest = [i for i in indices if i not in held]
        inner[mix] = R_in = radius_on(rest) if rest else R
        pairs += [(wt, wp, ss) for i in held for wt, wp, ss, _ in matched(tasks[i], quants_at(i, R_in))]
    se_sys = calibrate_se(pairs)
    return QuantModel(radius_um=R, se_sys=se_sys), {"radius_um": R, "se_sys": se_sys,
                                                    "coverage_rest": round(coverage(pairs, se_sys), 4),
                                                    "inner_radii": sorted(set(inner.values()))}


def evaluate_loo(tasks: list[Task], strict: bool = False, record_db: RecordDB | None = None,
                 progress: Callable[[str], None] | None = None, grid=None, traced=None) -> tuple[EvalReport, dict]:
    """Leave one mixture out: everything the baseline fits on data is fitted on the other mixtures only.

    Each pattern's greedy refinement trace is computed once (:func:`trace_all`, or ``traced``);
    for each held-out mixture, :func:`loo_folds` picks the thresholds of ``grid`` on the rest,
    then :func:`choose_quant` the Brindley radius and the standard errors' model term on the
    rest's scans at those thresholds, and they decide its scans.  Returns the report over every
    held-out scan (rows carry the uncorrected fractions and each phase's s.e.) and per-fold
    details (chosen thresholds, radius, se_sys, detection limits, held-out coverage of +-2 s.e.).
    """
    grid = tuple(grid or THRESHOLD_GRID)
    traces, seconds, cpu = traced or trace_all(tasks, record_db, progress)
    outcome: dict = {}
    report = EvalReport("real_dev-loo")
    folds = {}
    qcache: dict = {}
    for mix, fold in loo_folds(tasks, traces, grid, strict, outcome).items():
        th = fold["thresholds"]
        fits = {i: (traces[i], traces[i].final_fit(th)[0]) for i in fold["rest"]}
        quant, qinfo = choose_quant(tasks, fits, fold["rest"], qcache)
        folds[mix] = {"thresholds": th.__dict__, "rest_successes": fold["rest_successes"],
                      "rest_n": len(fold["rest"]), "quant": qinfo}
        for i in fold["held"]:
            res = traces[i].final_fit(th)[0]
            sol, g = _decide(traces[i], th, tasks[i], strict, quant)
            report.add(tasks[i], sol.phases, g, seconds[i], cpu[i])
            qs = [] if res is None else traces[i].quantify(res, quant)
            pairs = matched(tasks[i], qs) if qs else []
            uncorrected = [(q.phase_id, q.uncorrected) for q in qs]
            report.rows[-1].update({
                "uncorrected": [(p, round(w, 4)) for p, w in uncorrected],
                "abs_errors_uncorrected": grade(uncorrected, tasks[i].truth).details["abs_errors"],
                "se": {q.phase_id: round(q.se, 4) for q in qs},
                "within_2se": [abs(wp - wt) <= SE_K * se for wt, wp, _, se in pairs]})
            fit = sol.details.get("fit", {})
            folds[mix].setdefault("scans", {})[scan_of(tasks[i])] = {
                "success": g.success, "detection_limits": {
                    p["phase_id"]: round(th.z_min * p["wf_esd"], 4) for p in fit.get("phases", [])},
                "not_detectable": sol.details.get("not_detectable", []),
                "moved": {q.phase_id: round(q.moved, 4) for q in qs}}
            if progress:
                progress(f"{tasks[i].id}: thresholds {th.__dict__}, radius {quant.radius_um} um, se_sys "
                         f"{quant.se_sys} (fitted on {len(fold['rest'])} other scans) success={g.success}")
    return report, folds


def moved_by_mixture(folds: dict) -> dict[str, dict[str, float]]:
    """Per held-out mixture, how much the microabsorption correction moved each phase (mean over its scans)."""
    out: dict[str, dict[str, float]] = {}
    for mix, f in folds.items():
        acc: dict[str, list[float]] = {}
        for row in f.get("scans", {}).values():
            for pid, d in row.get("moved", {}).items():
                acc.setdefault(pid, []).append(d)
        out[mix.rpartition(":")[2]] = {pid.partition(":")[2] or pid: round(sum(v) / len(v), 4)
                                       for pid, v in acc.items()}
    return out


def loo_quant_summary(report: EvalReport) -> dict:
    """What the leave-one-mixture-out rows say about the correction and the standard errors."""
    inside = [b for r in report.rows for b in r.get("within_2se", [])]
    unc = [e for r in report.rows for e in r.get("abs_errors_uncorrected", {}).values()]
    return {"coverage_2se": round(sum(inside) / max(1, len(inside)), 4), "n_fractions": len(inside),
            "wf_mae_uncorrected": round(sum(unc) / max(1, len(unc)), 4)}


def _decide(tr, th, task: Task, strict: bool, quant=None):
    sol = tr.decide(th) if quant is None else tr.decide(th, quant)
    return sol, grade(sol.phases, task.truth, strict=strict)


def detection_limits_by_scan(folds: dict) -> dict[str, dict]:
    """Median and max detection limit (weight fraction) of the refined phases, per scan length."""
    by: dict[str, list[float]] = {}
    for f in folds.values():
        for scan, row in f.get("scans", {}).items():
            by.setdefault(scan, []).extend(row["detection_limits"].values())
    return {k: {"median": round(statistics.median(v), 4), "max": round(max(v), 4), "n": len(v)}
            for k, v in sorted(by.items()) if v}


def _grid_answers(args) -> list:
    """(worker) one task's answers at every grid point: [(phases, success, abs errors), ...]."""
    task, grid = args
    t0, c0 = time.perf_counter(), time.process_time()
    record_db = build_record_db([task], ":memory:", include_real=False)
    tr = baseline.trace(make_context(task, record_db))
    out = []
    for th in grid:
        sol = tr.decide(th)
        g = grade(sol.phases, task.truth)
        out.append((sol.phases, g))
    return out, time.perf_counter() - t0, time.process_time() - c0


def choose_thresholds(answers: list, grid) -> int:
    """Index of the grid point with the most successes over ``answers`` (ties: lower MAE, then earlier)."""
    def score(j):
        gs = [a[j][1] for a in answers]
        errs = [e for g in gs for e in g.details["abs_errors"].values()]
        return (sum(g.success for g in gs), -sum(errs) / max(1, len(errs)), -j)
    return max(range(len(grid)), key=score)


def thresholds_fitted_on_train(preset: str, n: int, seed: int = 0, workers: int = 2, grid=None,
                               progress: Callable[[str], None] | None = None) -> tuple[object, dict]:
    """The baseline's thresholds fitted on ``n`` train tasks of ``preset`` (nothing of another split is seen)."""
    grid = tuple(grid or THRESHOLD_GRID)
    train = load_tasks(preset, "train", seed, n)
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(train)))) as pool:
        answers = [r[0] for r in pool.map(_grid_answers, [(t, grid) for t in train])]
    best = choose_thresholds(answers, grid)
    info = {"thresholds": grid[best].__dict__, "train_successes": sum(a[best][1].success for a in answers),
            "train_n": len(train), "train_tasks": [t.id for t in train]}
    if progress:
        progress(f"thresholds {info['thresholds']} ({info['train_successes']}/{len(train)} train tasks)")
    return grid[best], info


def evaluate_fit_on_train(preset: str, split: str, n: int, seed: int = 0, workers: int = 2, grid=None,
                          progress: Callable[[str], None] | None = None) -> tuple[EvalReport, dict]:
    """Synthetic presets: the baseline's thresholds fitted on ``n`` train tasks, scored on ``split``."""
    if split == "train":
        raise ValueError("fit-on-train scores a split other than train (the thresholds are fitted there)")
    grid = tuple(grid or THRESHOLD_GRID)
    train, test = load_tasks(preset, "train", seed, n), load_tasks(preset, split, seed, n)
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(_grid_answers, [(t, grid) for t in train + test]))
    tr_ans = [r[0] for r in results[:len(train)]]
    best = choose_thresholds(tr_ans, grid)
    rep = EvalReport(f"{preset}/{split} (thresholds fitted on {len(train)} train tasks)")
    for task, (ans, wall, cpu) in zip(test, results[len(train):]):
        phases, g = ans[best]
        rep.add(task, phases, g, wall, cpu)
    info = {"thresholds": grid[best].__dict__,
            "train_successes": sum(a[best][1].success for a in tr_ans), "train_n": len(train)}
    if progress:
        progress(f"thresholds {info['thresholds']} ({info['train_successes']}/{len(train)} train tasks)")
    return rep, info
