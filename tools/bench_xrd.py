#!/usr/bin/env python
"""Benchmark of the XRD environment: simulation speed vs pymatgen, baseline success per split.

    python tools/bench_xrd.py                       # defaults: a few minutes on 2 cores
    python tools/bench_xrd.py --n 50 --repeat 5     # bigger

1. Simulation: the same structures (every real-data phase + AFLOW prototypes of other lattice
   systems) through pymatgen's ``XRDCalculator.get_pattern`` and through ours (uncached:
   reflections + merged stick pattern), best of ``--repeat`` timings each; peaks must be
   identical (positions 1e-3 deg, intensities 1 %) or the speedup is reported as 0.
2. Baseline solver success (Wilson 95 % interval) on easy and realistic synthetic tasks
   (``--splits``), and on the labelled real precursor mixtures (both scan lengths) when
   ``shared/data/xrd-real`` is found.

3. Real dev set, leave one mixture out (``xrd.evaluate.evaluate_loo``): the baseline's detection
   thresholds, then its Brindley radius and s.e. model term, are fitted on the other mixtures for
   each held-out one; the default-threshold
   score comes from the same traces.  ``xrd_fit_seconds``: CPU seconds of the whole baseline per
   real pattern (search + refinements, one core); ``xrd_refine_seconds``: one refinement of the
   true phases.

Last line: ``RESULT xrd_sim_speedup_vs_pymatgen=... xrd_baseline_success_easy=...
xrd_baseline_success_realistic=... xrd_baseline_success_real=... xrd_baseline_success_real_loo=...
xrd_baseline_success_real_loo_2min=... xrd_baseline_wf_mae_real_loo=...
xrd_baseline_success_real_loo_strict=... (+-5 wt%; _2min/_8min per scan length)
xrd_baseline_wf_mae_real_loo_2min=... _8min=... xrd_baseline_se_coverage_real_loo=... xrd_fit_seconds=...
xrd_refine_seconds=...``.  The real-data lines are followed by the strict report: success at +-10
and +-5 wt%, MAE and s/pattern (wall, CPU) overall and per scan length; the loo line also by the
Brindley radii and s.e. model terms the folds chose, how much the correction moved each phase, and
the share of held-out true fractions inside +-2 s.e.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np

REAL_PHASE_IDS = ["cur:Li2CO3_zabuyelite", "cur:ZrO2_baddeleyite", "cur:NiO_bunsenite", "cur:LaOH3",
                  "cur:TiO2_anatase", "cur:TiO2_rutile", "cur:ZnO_zincite", "cur:In2O3_bixbyite",
                  "cur:MnCO3_rhodochrosite", "cur:Bi2O3_alpha", "cur:V2O5_shcherbinaite"]


def _structures(n_extra: int):
    from neon_hpc.envs.xrd.science.library import load_library
    lib = load_library()
    extra = [p.id for p in lib.phases if p.source == "aflow" and len(p.species) <= 40][:: 7][:n_extra]
    return [lib.get(pid) for pid in REAL_PHASE_IDS + extra]


def bench_simulation(repeat: int, n_extra: int) -> dict:
    warnings.filterwarnings("ignore")
    from pymatgen.analysis.diffraction.xrd import XRDCalculator

    from neon_hpc.envs.xrd.science.simulate import CU_KA_AVG, compute_reflections, stick_pattern
    phases = _structures(n_extra)
    structures = [p.structure() for p in phases]
    arrays = [(np.asarray(p.lattice), list(p.species), np.asarray(p.frac_coords)) for p in phases]
    calc = XRDCalculator()
    d_min = CU_KA_AVG / (2 * np.sin(np.radians(45.0))) * 0.999

    def run_pymatgen():
        return [calc.get_pattern(s, two_theta_range=(10, 90)) for s in structures]

    def run_ours():
        return [stick_pattern(compute_reflections(lat, sp, fc, d_min), CU_KA_AVG, (10, 90)) for lat, sp, fc in arrays]

    t_pm, t_ours = [], []
    ref = ours = None
    inner = 10          # ours is fast: time 10 passes per sample so timer noise does not dominate
    for _ in range(repeat):
        t0 = time.perf_counter()
        ref = run_pymatgen()
        t_pm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(inner):
            ours = run_ours()
        t_ours.append((time.perf_counter() - t0) / inner)
    mismatches = 0
    for r, (x, y, _h) in zip(ref, ours):
        if len(x) != len(r.x) or np.max(np.abs(x - np.asarray(r.x))) > 1e-3 or \
                np.any(np.abs(y - np.asarray(r.y)) > 0.01 * np.maximum(r.y, 1.0)):
            mismatches += 1
    best_pm, best_ours = min(t_pm), min(t_ours)
    return {"structures": len(phases), "pymatgen_s": best_pm, "ours_s": best_ours,
            "speedup": (best_pm / best_ours) if mismatches == 0 else 0.0, "mismatches": mismatches,
            "peaks": int(sum(len(x) for x, _, _ in ours))}


def bench_baseline(preset: str, split: str, n: int) -> dict:
    from neon_hpc.envs.xrd.science.evaluate import evaluate
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    rep = evaluate(load_tasks(preset, split, seed=0, n=n), name=f"{preset}/{split}",
                   progress=lambda m: print("  " + m, file=sys.stderr, flush=True))
    return rep.summary()


def bench_real(measured: bool = True) -> tuple[dict, dict] | None:
    """The real dev set: default thresholds and leave-one-mixture-out, from one trace per pattern."""
    from neon_hpc.envs.xrd.science.baseline import Thresholds
    from neon_hpc.envs.xrd.science.evaluate import (
        detection_limits_by_scan,
        evaluate_loo,
        loo_quant_summary,
        moved_by_mixture,
        report_from_traces,
        scan_of,
        trace_all,
    )
    from neon_hpc.envs.xrd.science.real import load_real_tasks, real_data_dir
    if real_data_dir() is None:
        return None
    tasks = load_real_tasks("precursor_mixture", measured=measured)
    traced = trace_all(tasks, progress=lambda m: print("  " + m, file=sys.stderr, flush=True))
    out = []
    for rep, folds in ((report_from_traces(tasks, traced[0], Thresholds(), traced[1], "real_dev", cpu=traced[2]), None),
                       evaluate_loo(tasks, traced=traced)):
        by_scan = {}
        for t, row in zip(tasks, rep.rows):
            by_scan.setdefault(scan_of(t), []).append(row["success"])
        s = rep.summary()
        s["by_scan"] = {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_scan.items())}
        s["success_by_scan"] = {k: sum(v) / len(v) for k, v in by_scan.items()}
        if folds is not None:
            s["detection_limits"] = detection_limits_by_scan(folds)
            s["misses"] = [(r["task"], r["predicted"], r["truth"]) for r in rep.rows if not r["success"]]
            s["misses_strict"] = [(r["task"], r["predicted"], r["truth"]) for r in rep.rows if not r["success_5"]]
            s["quant"] = loo_quant_summary(rep)
            s["radii"] = sorted({f["quant"]["radius_um"] for f in folds.values()})
            s["se_sys"] = sorted({f["quant"]["se_sys"] for f in folds.values()})
            s["moved"] = moved_by_mixture(folds)
        out.append(s)
    out[0]["cpu_per_pattern"] = float(np.mean(traced[2]))
    out[0]["wall_per_pattern"] = float(np.mean(traced[1]))
    return out[0], out[1]


def bench_refine(n: int = 6) -> float:
    """CPU seconds of one whole-pattern refinement of the true phases (real 8-minute scans, else synthetic)."""
    from neon_hpc.envs.xrd.science.real import load_real_tasks, real_data_dir
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    from neon_hpc.envs.xrd.science.tools import TaskContext
    tasks = load_real_tasks(scan="8min")[:n] if real_data_dir() else load_tasks("realistic", "test_id", n=n)
    times = []
    for t in tasks:
        ctx = TaskContext.for_task(t, None)
        ids = [p or "cur:TiO2_anatase" for p, _, _ in t.truth]
        c0 = time.process_time()
        ctx.fitter().fit(ids)
        times.append(time.process_time() - c0)
    return float(np.mean(times))


def _line(s: dict) -> str:
    lo, hi = s["success_ci95"]
    return (f"{s['name']:<24} n={s['n']:<4} success={s['success']:.3f} [{lo:.3f}, {hi:.3f}] "
            f"phase_F1={s['phase_f1']:.3f} wf_MAE={s['wf_mae']:.4f} dense={s['dense']:.3f} "
            f"{s['seconds_per_task']} s/task")


def _scan(real, scan: str, key: str) -> float:
    """One scan length's figure of the loo strict report (nan without real data)."""
    if not real:
        return float("nan")
    return float(real[1]["strict"]["by_scan"].get(scan, {}).get(key, float("nan")))


def result_line(sim: dict, synthetic: dict, real, refine_s: float) -> str:
    """The ``RESULT`` line: ``synthetic`` = {"easy": summary, "realistic": summary}; ``real`` = bench_real() or None."""
    nan = float("nan")
    return (f"RESULT xrd_sim_speedup_vs_pymatgen={sim['speedup']:.2f} "
            f"xrd_baseline_success_easy={synthetic['easy']['success']:.3f} "
            f"xrd_baseline_success_realistic={synthetic['realistic']['success']:.3f} "
            f"xrd_baseline_success_real={real[0]['success'] if real else nan:.3f} "
            f"xrd_baseline_success_real_loo={real[1]['success'] if real else nan:.3f} "
            f"xrd_baseline_success_real_loo_2min={real[1]['success_by_scan'].get('2min', nan) if real else nan:.3f} "
            f"xrd_baseline_wf_mae_real_loo={real[1]['wf_mae'] if real else nan:.4f} "
            f"xrd_baseline_success_real_loo_strict={real[1]['strict']['success_5'] if real else nan:.3f} "
            f"xrd_baseline_success_real_loo_strict_2min={_scan(real, '2min', 'success_5'):.3f} "
            f"xrd_baseline_success_real_loo_strict_8min={_scan(real, '8min', 'success_5'):.3f} "
            f"xrd_baseline_wf_mae_real_loo_2min={_scan(real, '2min', 'wf_mae'):.4f} "
            f"xrd_baseline_wf_mae_real_loo_8min={_scan(real, '8min', 'wf_mae'):.4f} "
            f"xrd_baseline_se_coverage_real_loo={real[1]['quant']['coverage_2se'] if real else nan:.3f} "
            f"xrd_fit_seconds={real[0]['cpu_per_pattern'] if real else nan:.2f} "
            f"xrd_refine_seconds={refine_s:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="synthetic tasks per preset and split")
    ap.add_argument("--repeat", type=int, default=5, help="timing repeats (best of)")
    ap.add_argument("--extra-structures", type=int, default=20, help="AFLOW structures beside the real-data phases")
    ap.add_argument("--splits", default="test_id", help="comma-separated splits for the synthetic presets")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--measured", action=argparse.BooleanOptionalAction, default=True,
                    help="quantify the real scans' found phases with anomalous scattering (Instrument.measured; "
                         "default on, identification never uses it; --no-measured: the earlier fits)")
    args = ap.parse_args(argv)
    from neon_hpc.envs.xrd.science.evaluate import strict_lines

    sim = bench_simulation(args.repeat, args.extra_structures)
    print(f"simulation: {sim['structures']} structures, {sim['peaks']} peaks; pymatgen {sim['pymatgen_s']:.3f} s, "
          f"ours {sim['ours_s']:.3f} s -> {sim['speedup']:.1f}x (mismatching structures: {sim['mismatches']})",
          flush=True)
    results = {}
    for preset in ("easy", "realistic"):
        for split in args.splits.split(","):
            s = bench_baseline(preset, split, args.n)
            results[(preset, split)] = s
            print(_line(s), flush=True)
    real = None if args.skip_real else bench_real(args.measured)
    if real:
        fixed, loo = real
        print(_line(fixed) + f"  by scan: {fixed['by_scan']}  (default thresholds)", flush=True)
        print("\n".join(strict_lines(fixed)), flush=True)
        print(_line(loo) + f"  by scan: {loo['by_scan']}  (leave one mixture out)", flush=True)
        print("\n".join(strict_lines(loo)), flush=True)
        print(f"  detection limits (weight fraction, median / max): {loo['detection_limits']}", flush=True)
        print(f"  loo quantification: Brindley radius chosen per fold {loo['radii']} um, se_sys {loo['se_sys']}; "
              f"wf_MAE without the correction {loo['quant']['wf_mae_uncorrected']:.4f}; true fractions inside "
              f"+-2 s.e. {loo['quant']['coverage_2se']:.3f} of {loo['quant']['n_fractions']}", flush=True)
        for mix, moved in loo["moved"].items():
            print(f"  microabsorption moved {mix}: {moved}", flush=True)
        for m in loo["misses"]:
            print(f"  loo miss: {m}", flush=True)
        for m in loo["misses_strict"]:
            print(f"  loo miss at +-5 wt%: {m}", flush=True)
        print(f"  baseline per real pattern: {fixed['cpu_per_pattern']:.2f} s CPU, "
              f"{fixed['wall_per_pattern']:.2f} s wall", flush=True)
    else:
        print("real data: not found (set NEON_XRD_REAL_DATA) or skipped")
    refine_s = bench_refine()
    print(f"one refinement of the true phases: {refine_s:.2f} s CPU", flush=True)
    first = args.splits.split(",")[0]
    print(result_line(sim, {p: results[(p, first)] for p in ("easy", "realistic")}, real, refine_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
