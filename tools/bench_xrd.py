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

Last line: ``RESULT xrd_sim_speedup_vs_pymatgen=... xrd_baseline_success_easy=...
xrd_baseline_success_realistic=... xrd_baseline_success_real=...``
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
    from neon_hpc.xrd.library import load_library
    lib = load_library()
    extra = [p.id for p in lib.phases if p.source == "aflow" and len(p.species) <= 40][:: 7][:n_extra]
    return [lib.get(pid) for pid in REAL_PHASE_IDS + extra]


def bench_simulation(repeat: int, n_extra: int) -> dict:
    warnings.filterwarnings("ignore")
    from pymatgen.analysis.diffraction.xrd import XRDCalculator
    from neon_hpc.xrd.simulate import CU_KA_AVG, compute_reflections, stick_pattern
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
    from neon_hpc.xrd.evaluate import evaluate
    from neon_hpc.xrd.tasks import load_tasks
    rep = evaluate(load_tasks(preset, split, seed=0, n=n), name=f"{preset}/{split}",
                   progress=lambda m: print("  " + m, file=sys.stderr, flush=True))
    return rep.summary()


def bench_real() -> dict | None:
    from neon_hpc.xrd.evaluate import evaluate
    from neon_hpc.xrd.real import load_real_tasks, real_data_dir
    if real_data_dir() is None:
        return None
    rep = evaluate(load_real_tasks("precursor_mixture"), name="real_dev",
                   progress=lambda m: print("  " + m, file=sys.stderr, flush=True))
    by_scan = {}
    for row in rep.rows:
        scan = row["task"].rsplit("--", 1)[-1]
        by_scan.setdefault(scan, []).append(row["success"])
    s = rep.summary()
    s["by_scan"] = {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_scan.items())}
    return s


def _line(s: dict) -> str:
    lo, hi = s["success_ci95"]
    return (f"{s['name']:<24} n={s['n']:<4} success={s['success']:.3f} [{lo:.3f}, {hi:.3f}] "
            f"phase_F1={s['phase_f1']:.3f} wf_MAE={s['wf_mae']:.4f} dense={s['dense']:.3f} "
            f"{s['seconds_per_task']} s/task")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="synthetic tasks per preset and split")
    ap.add_argument("--repeat", type=int, default=5, help="timing repeats (best of)")
    ap.add_argument("--extra-structures", type=int, default=20, help="AFLOW structures beside the real-data phases")
    ap.add_argument("--splits", default="test_id", help="comma-separated splits for the synthetic presets")
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args(argv)

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
    real = None if args.skip_real else bench_real()
    if real:
        print(_line(real) + f"  by scan: {real['by_scan']}", flush=True)
    else:
        print("real data: not found (set NEON_XRD_REAL_DATA) or skipped")
    first = args.splits.split(",")[0]
    print(f"RESULT xrd_sim_speedup_vs_pymatgen={sim['speedup']:.2f} "
          f"xrd_baseline_success_easy={results[('easy', first)]['success']:.3f} "
          f"xrd_baseline_success_realistic={results[('realistic', first)]['success']:.3f} "
          f"xrd_baseline_success_real={real['success'] if real else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
