"""``neon-hpc xrd ...``: library listing, task files, evaluation.

    neon-hpc xrd library [--list] [--elements Ti,O] [--source curated]
    neon-hpc xrd tasks --preset easy --split train [--seed 0] [--n 50] --out DIR [--db postgresql://...]
    neon-hpc xrd eval --solver baseline --preset easy --split test_id [--n 20] [--json OUT]
    neon-hpc xrd eval --solver baseline --data ../shared/data/xrd-real [--scan 8min] [--protocol loo]
    neon-hpc xrd eval --endpoint URL ...      (LLM agent: the XRD plugin's neon_hpc.envs.xrd.eval_cli;
                                               `neon-hpc xrd` is neon_hpc/envs/xrd/cli.py, which hands
                                               the rest here: this package never imports the rollout)
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from neon_hpc.envs.xrd.science.records import RecordDBError

SPLIT_CHOICES = ("train", "test_id", "test_ood", "test_temporal", "all")


def _cmd_library(args) -> int:
    # the numpy-backed xrd modules are imported where used: `--help` stays light
    # deferred: heavy (neon_hpc.envs.xrd.science.library: numpy)
    from neon_hpc.envs.xrd.science.library import load_library
    lib = load_library()
    phases = lib.phases
    if args.source:
        phases = [p for p in phases if p.source == args.source]
    if args.elements:
        phases = lib.within([e.strip() for e in args.elements.split(",")])
        phases = [p for p in phases if not args.source or p.source == args.source]
    by_source = Counter(p.source for p in phases)
    print(f"{len(phases)} phases ({', '.join(f'{k}: {v}' for k, v in sorted(by_source.items()))}); "
          f"answer-eligible: {sum(p.answer_eligible for p in phases)}")
    if args.list or args.elements:
        for p in phases:
            s = p.summary()
            print(f"  {s['id']:<48} {s['formula']:<12} {s['spacegroup']:<10} {s['year']}  {p.source}"
                  f"{'' if p.answer_eligible else '  (distractor)'}")
    return 0


def _cmd_tasks(args) -> int:
    # deferred: heavy (neon_hpc.envs.xrd.science.tasks: numpy, jsonschema)
    from neon_hpc.envs.xrd.science.tasks import load_tasks, write_tasks
    splits = [s for s in SPLIT_CHOICES if s != "all"] if args.split == "all" else [args.split]
    for split in splits:
        tasks = load_tasks(args.preset, split, args.seed, args.n)
        out = Path(args.out) / f"{args.preset}-{split}-s{args.seed}" if len(splits) > 1 else Path(args.out)
        try:
            info = write_tasks(tasks, out, include_real=not args.no_real, db=args.db)
        except (RecordDBError, ValueError) as e:
            print(f"neon-hpc xrd tasks: {e}", file=sys.stderr)
            return 2
        print(f"wrote {info['tasks']} tasks to {info['dir']} and {info['experiments']} experiment records "
              f"to {info['record_db']}")
    return 0


def _refuse_endpoint() -> int:
    """--endpoint reached this module directly (not through ``neon-hpc``): the agent evaluator is the plugin's."""
    print("neon-hpc xrd eval --endpoint: the LLM agent evaluation is the XRD plugin's (neon_hpc/envs/xrd/); run it as "
          "`neon-hpc xrd eval --endpoint URL ...` or "
          "`python -m neon_hpc.envs.xrd.eval_cli --endpoint URL ...`", file=sys.stderr)
    return 2


def _cmd_eval(args, argv: list[str]) -> int:
    if args.endpoint:
        return _refuse_endpoint()
    # deferred: heavy (neon_hpc.envs.xrd.science.evaluate, neon_hpc.envs.xrd.science.tasks: numpy, jsonschema)
    from neon_hpc.envs.xrd.science.evaluate import SOLVERS, evaluate, strict_lines
    from neon_hpc.envs.xrd.science.tasks import load_tasks, read_tasks
    if args.solver not in SOLVERS:
        print(f"unknown solver {args.solver!r}; choose from {', '.join(SOLVERS)}", file=sys.stderr)
        return 2
    progress = (lambda m: print(m, file=sys.stderr)) if args.verbose else None
    if args.protocol == "loo":
        return _eval_loo(args, progress)
    if args.protocol == "fit-on-train":
        # deferred: heavy (neon_hpc.envs.xrd.science.evaluate: numpy, jsonschema)
        from neon_hpc.envs.xrd.science.evaluate import evaluate_fit_on_train
        if args.data or args.tasks or args.split in ("train", "all") or args.solver != "baseline":
            print("neon-hpc xrd eval --protocol fit-on-train: synthetic presets only (--preset P --split test_id|"
                  "test_ood|test_temporal), --solver baseline; thresholds are fitted on --n train tasks",
                  file=sys.stderr)
            return 2
        rep, info = evaluate_fit_on_train(args.preset, args.split, args.n, args.seed, progress=progress)
        s = rep.summary()
        lo, hi = s["success_ci95"]
        print(f"{args.preset + '/' + args.split:<28} n={s['n']:<4} success={s['success']:.3f} [{lo:.3f}, {hi:.3f}]  "
              f"phase_F1={s['phase_f1']:.3f}  wf_MAE={s['wf_mae']:.4f}  dense={s['dense']:.3f}  "
              f"(thresholds {info['thresholds']} fitted on {info['train_n']} train tasks: "
              f"{info['train_successes']}/{info['train_n']})")
        print("\n".join(strict_lines(s)))
        if args.json:
            Path(args.json).write_text(json.dumps({"solver": args.solver, "protocol": "fit-on-train", "info": info,
                                                   "results": [{**s, "rows": rep.rows}]}, indent=1))
        return 0
    groups = []
    if args.data:
        # deferred: heavy (neon_hpc.envs.xrd.science.real: numpy, jsonschema)
        from neon_hpc.envs.xrd.science.real import load_real_tasks
        tasks = load_real_tasks("precursor_mixture", scan=args.scan, data_dir=args.data, measured=args.measured)
        groups.append((f"real_dev{'-' + args.scan if args.scan else ''}", tasks))
    elif args.tasks:
        tasks = read_tasks(args.tasks)
        groups.append((Path(args.tasks).name, tasks))
    else:
        splits = [s for s in SPLIT_CHOICES if s != "all"] if args.split == "all" else [args.split]
        for split in splits:
            groups.append((f"{args.preset}/{split}", load_tasks(args.preset, split, args.seed, args.n)))
    summaries = []
    for name, tasks in groups:
        rep = evaluate(tasks, SOLVERS[args.solver], name=name, strict=args.strict, progress=progress)
        s = rep.summary()
        summaries.append({**s, "rows": rep.rows})
        lo, hi = s["success_ci95"]
        print(f"{name:<28} n={s['n']:<4} success={s['success']:.3f} [{lo:.3f}, {hi:.3f}]  "
              f"phase_F1={s['phase_f1']:.3f}  wf_MAE={s['wf_mae']:.4f}  dense={s['dense']:.3f}  "
              f"({s['seconds_per_task']} s/task)")
        print("\n".join(strict_lines(s)))
    if args.json:
        Path(args.json).write_text(json.dumps({"solver": args.solver, "results": summaries}, indent=1))
    return 0


def _eval_loo(args, progress) -> int:
    """Leave one mixture out on the real dev set: thresholds fitted on the other mixtures only."""
    if not args.data or args.solver != "baseline":
        print("neon-hpc xrd eval --protocol loo: needs --data DIR (the real dev set, e.g. ../shared/data/xrd-real) "
              "and --solver baseline (the solver whose thresholds it fits)", file=sys.stderr)
        return 2
    # deferred: heavy (neon_hpc.envs.xrd.science.evaluate, neon_hpc.envs.xrd.science.real: numpy, jsonschema)
    from neon_hpc.envs.xrd.science.evaluate import (
        detection_limits_by_scan,
        evaluate_loo,
        loo_quant_summary,
        moved_by_mixture,
        scan_of,
        strict_lines,
    )
    from neon_hpc.envs.xrd.science.real import load_real_tasks
    tasks = load_real_tasks("precursor_mixture", scan=args.scan, data_dir=args.data, measured=args.measured)
    rep, folds = evaluate_loo(tasks, strict=args.strict, progress=progress)
    s = rep.summary()
    lo, hi = s["success_ci95"]
    by_scan: dict[str, list[bool]] = {}
    for t, row in zip(tasks, rep.rows):
        by_scan.setdefault(scan_of(t), []).append(row["success"])
    print(f"{'real_dev loo':<28} n={s['n']:<4} success={s['success']:.3f} [{lo:.3f}, {hi:.3f}]  "
          f"phase_F1={s['phase_f1']:.3f}  wf_MAE={s['wf_mae']:.4f}  dense={s['dense']:.3f}  "
          f"({s['seconds_per_task']} s/task)")
    print("  by scan: " + ", ".join(f"{k} {sum(v)}/{len(v)}" for k, v in sorted(by_scan.items())))
    print("\n".join(strict_lines(s)))
    qsum = loo_quant_summary(rep)
    print(f"  true fractions inside +-2 s.e.: {qsum['coverage_2se']:.3f} of {qsum['n_fractions']} (held-out "
          f"mixtures); wf_MAE without the microabsorption correction {qsum['wf_mae_uncorrected']:.4f}")
    radii: dict[str, int] = {}
    for f in folds.values():
        key = f"radius {f['quant']['radius_um']} um, se_sys {f['quant']['se_sys']}"
        radii[key] = radii.get(key, 0) + 1
    print("  quantification chosen per fold: " + ", ".join(f"{k} ({v}x)" for k, v in sorted(radii.items())))
    for mix, moved in moved_by_mixture(folds).items():
        print(f"  microabsorption moved {mix}: {moved}")
    limits = detection_limits_by_scan(folds)
    print("  detection limit (z_min x esd of w, median / max over refined phases): " +
          ", ".join(f"{k} {v['median']:.3f} / {v['max']:.3f}" for k, v in limits.items()))
    chosen: dict[str, int] = {}
    for f in folds.values():
        key = f"gain>={f['thresholds']['min_gain']} z>={f['thresholds']['z_min']}"
        chosen[key] = chosen.get(key, 0) + 1
    print("  thresholds chosen per fold: " + ", ".join(f"{k} ({v}x)" for k, v in sorted(chosen.items())))
    for row in rep.rows:
        if not row["success"]:
            print(f"  miss: {row['task']}: predicted {row['predicted']} truth {row['truth']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"solver": args.solver, "protocol": "loo",
                                               "results": [{**s, "rows": rep.rows}], "folds": folds,
                                               "quant": qsum,
                                               "detection_limits": limits}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neon-hpc xrd", description="the XRD environment")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lib = sub.add_parser("library", help="phase library summary / listing")
    lib.add_argument("--list", action="store_true")
    lib.add_argument("--elements", help="comma-separated: phases made of (a subset of) these")
    lib.add_argument("--source", choices=("curated", "aflow", "ase", "substitution"))
    tk = sub.add_parser("tasks", help="write task files (tasks.jsonl + experiments.sqlite)")
    tk.add_argument("--preset", required=True, choices=("tiny", "easy", "medium", "realistic"))
    tk.add_argument("--split", required=True, choices=SPLIT_CHOICES)
    tk.add_argument("--seed", type=int, default=0)
    tk.add_argument("--n", type=int, default=None)
    tk.add_argument("--out", required=True)
    tk.add_argument("--no-real", action="store_true", help="leave the real patterns out of the records database")
    tk.add_argument("--db", help="postgresql://USER@HOST:PORT/DB: write the experiments there instead of "
                                 "DIR/experiments.sqlite (the folder records the DSN, without its password)")
    ev = sub.add_parser("eval", help="evaluate a solver (or an LLM agent with --endpoint)")
    ev.add_argument("--solver", default="baseline")
    ev.add_argument("--preset", default="easy", choices=("tiny", "easy", "medium", "realistic"))
    ev.add_argument("--split", default="test_id", choices=SPLIT_CHOICES)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--n", type=int, default=20)
    ev.add_argument("--data", help="real data folder (xrd-real): scores its labelled precursor mixtures")
    ev.add_argument("--scan", choices=("2min", "8min"), help="only this scan length of the real data")
    ev.add_argument("--tasks", help="a task folder written by `neon-hpc xrd tasks`")
    ev.add_argument("--protocol", choices=("fixed", "loo", "fit-on-train"), default="fixed",
                    help="fixed: the solver's default thresholds; loo: leave one real mixture out, thresholds "
                         "fitted on the other mixtures (needs --data); fit-on-train: synthetic preset, thresholds "
                         "fitted on --n train tasks, scored on --split")
    ev.add_argument("--strict", action="store_true", help="+-5 wt%% instead of +-10")
    ev.add_argument("--measured", action=argparse.BooleanOptionalAction, default=True,
                    help="real data (default on): quantify the found phases with anomalous scattering (f', f'') "
                         "and, outside a protocol, the prior's Brindley radius; identification never uses f', f'' "
                         "(Instrument.measured; --no-measured: the earlier fits, see the xrd README)")
    ev.add_argument("--json", help="write the summary and per-task rows here")
    ev.add_argument("--endpoint", help="evaluate an LLM agent at this URL (`neon-hpc xrd eval --endpoint URL "
                                       "--help` for its options: neon_hpc.envs.xrd.eval_cli)")
    ev.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval" and any(a == "--endpoint" or a.startswith("--endpoint=") for a in argv[1:]):
        return _refuse_endpoint()       # neon_hpc/envs/xrd/cli.py sends `xrd eval --endpoint` to the plugin
    args = build_parser().parse_args(argv)
    if args.cmd == "library":
        return _cmd_library(args)
    if args.cmd == "tasks":
        return _cmd_tasks(args)
    return _cmd_eval(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
