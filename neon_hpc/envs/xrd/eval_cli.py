"""``neon-hpc xrd eval --endpoint URL --model NAME --split ...``: evaluate any compatible endpoint.

The XRD plugin's LLM agent evaluation (``neon-hpc xrd eval --endpoint``: ``neon_hpc/envs/xrd/cli.py``).
Runs XRD episodes against our embedded engine or SGLang (``--api generate``: token ids in,
token ids out, our chat template) or an OpenAI-style chat API (``--api chat``), with
concurrency, retries on transient HTTP errors and a progress bar, and writes a report per
split: success rate with a 95% Wilson interval, phase F1, weight MAE, turns and tokens per
episode, tokens per solved sample.  ``--tools minimal`` is the toolset ablation.  Optional
``--judge URL=MODEL`` (repeatable) adds a panel of LLM judges (majority vote); the report then
shows their agreement with the deterministic grader, which stays the score.

``--protocol`` (as ``neon-hpc xrd eval --protocol`` does for the baseline): the significance
threshold the agent's ``fit_phases`` applies ("detected" / "not detectable") is never taken from
what is scored.  ``fixed``: the a-priori ``DETECTION_Z_MIN``.  ``loo`` (``--split real``): for each
held-out mixture, the baseline's thresholds fitted on the *other* mixtures' scans
(``xrd.evaluate.loo_folds``) set its scans' ``fit_phases``.  ``fit-on-train`` (synthetic splits
other than train): the thresholds fitted on ``--n`` train tasks of the preset
(``xrd.evaluate.thresholds_fitted_on_train``).  Each episode records the threshold it used and the
tasks it was fitted on.

Outputs: ``OUT/eval.json`` (summaries and every episode's record) and ``OUT/eval.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.envs.base import ConfiguredEnv
from neon_hpc.envs.xrd.config import XRDConfig
from neon_hpc.envs.xrd.plugin import PLUGIN
from neon_hpc.envs.xrd.report import markdown_table, summarize
from neon_hpc.envs.xrd.science import evaluate
from neon_hpc.envs.xrd.science.baseline import THRESHOLD_GRID
from neon_hpc.envs.xrd.science.real import load_real_tasks
from neon_hpc.envs.xrd.science.tasks import SPLITS, load_tasks
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.protocol.rundir import atomic_write_json, atomic_write_text
from neon_hpc.rollout.agent.chat import ChatClient, ChatEpisode
from neon_hpc.rollout.agent.group import as_environment, run_episode
from neon_hpc.util.constraints import errors

PROTOCOLS = ("fixed", "loo", "fit-on-train")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neon-hpc xrd eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("--model", default="default", help="model name (chat API) or label (generate API)")
    ap.add_argument("--api", choices=("auto", "generate", "chat"), default="auto",
                    help="generate: SGLang /generate with token ids; chat: /v1/chat/completions; "
                         "auto: generate if GET /get_model_info answers")
    ap.add_argument("--split", default="test_id",
                    help=f"comma-separated splits among {', '.join(SPLITS)}, or 'real' (development set)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n", type=int, default=32, help="tasks per split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tools", choices=("full", "minimal"), default="full")
    ap.add_argument("--prompt-style", choices=("auto", "compact", "full"), default="auto",
                    help="auto: compact for the tiny preset (our tiny model), full otherwise")
    ap.add_argument("--tokenizer", default="xrd-tiny", help="generate API: 'xrd-tiny' or a local HF tokenizer dir")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--retries", type=int, default=3, help="retries of a request on transient HTTP errors")
    ap.add_argument("--api-key", default=None, help="chat API key (or leave empty for local servers)")
    ap.add_argument("--judge", action="append", default=[], metavar="URL=MODEL",
                    help="an LLM judge (chat API); repeat for a panel (majority vote)")
    ap.add_argument("--data", default="", help="real data folder for --split real (default: the one xrd finds)")
    ap.add_argument("--protocol", choices=PROTOCOLS, default="fixed",
                    help="fit_phases' detection threshold: fixed (a priori); loo (--split real: fitted on the "
                         "other mixtures); fit-on-train (synthetic test splits: fitted on --n train tasks)")
    ap.add_argument("--out", default="eval_out", help="folder for eval.json and eval.md")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def rollout_config(args) -> RolloutConfig:
    cfg = RolloutConfig(temperature=args.temperature, request_retries=args.retries)
    if args.preset != "tiny":   # real models need room: more turns, longer outputs
        cfg = replace(cfg, max_turns=12, max_new_tokens=1024, max_total_tokens=32768)
    for field, value in (("max_turns", args.max_turns), ("max_new_tokens", args.max_new_tokens),
                         ("max_total_tokens", args.max_total_tokens)):
        if value is not None:
            cfg = replace(cfg, **{field: value})
    return _checked(cfg)


def xrd_settings(args) -> XRDConfig:
    """The ``env:`` section (kind xrd) the episodes are built with: ``--tools``, and ``--prompt-style`` (auto:
    compact for the tiny preset, full for any other ``--preset``, whatever a task's own preset)."""
    style = args.prompt_style if args.prompt_style != "auto" else ("auto" if args.preset == "tiny" else "full")
    return _checked(XRDConfig(tools=args.tools, prompt_style=style))


def _checked(section):
    errs = errors(section)
    if errs:
        raise SystemExit(f"neon-hpc xrd eval: {errs[0][0]}: {errs[0][1]}")
    return section


def detect_api(endpoint: str) -> str:
    import requests  # deferred: heavy (requests)
    try:
        r = requests.get(endpoint.rstrip("/") + "/get_model_info", timeout=5)
        if r.ok:
            return "generate"
    except requests.RequestException:
        pass
    return "chat"


def reachable(endpoint: str, api: str) -> str | None:
    """None when the server answers at all (any HTTP status); else why not."""
    import requests  # deferred: heavy (requests)
    path = "/health" if api == "generate" else ("/models" if endpoint.rstrip("/").endswith("/v1") else "/v1/models")
    try:
        requests.get(endpoint.rstrip("/") + path, timeout=10)
        return None
    except requests.RequestException as e:
        return f"{type(e).__name__}: {e}"


def load_split_tasks(args, split: str) -> list:
    if split == "real":    # the labelled real development set (precursor mixtures)
        return load_real_tasks("precursor_mixture", data_dir=args.data or None)[:args.n]
    return load_tasks(args.preset, split, seed=args.seed, n=args.n)


def _grade_numbers(details: Any) -> tuple[float | None, float | None]:
    """(phase F1, weight MAE in wt%) from the grader's details, when it reports them."""
    if not isinstance(details, dict):
        return None, None
    f1 = next((details[k] for k in ("phase_f1", "f1") if isinstance(details.get(k), (int, float))), None)
    mae = next((details[k] for k in ("weight_mae", "mae", "fraction_mae")
                if isinstance(details.get(k), (int, float))), None)
    return f1, mae


def protocol_error(protocol: str, splits: list[str]) -> str | None:
    """Why ``--protocol`` cannot score these splits, or None."""
    if protocol == "loo" and splits != ["real"]:
        return ("--protocol loo leaves one real mixture out: use it with --split real only "
                f"(got --split {','.join(splits)})")
    if protocol == "fit-on-train" and any(s in ("train", "real") for s in splits):
        return ("--protocol fit-on-train fits the threshold on train tasks of --preset: score test_id, test_ood "
                f"or test_temporal (got --split {','.join(splits)})")
    return None


def protocol_thresholds(args, tasks: list, cache: dict) -> tuple[list[dict | None], dict]:
    """Per task, the detection threshold its fit_phases uses and what it was fitted on; and the split's info.

    Never fitted on the task it is used for: ``loo`` fits on the other mixtures of ``tasks``,
    ``fit-on-train`` on train tasks only (one fit per run, kept in ``cache``).
    """
    if args.protocol == "fixed":
        return [None] * len(tasks), {"protocol": "fixed"}
    if args.protocol == "fit-on-train":
        if "train" not in cache:
            cache["train"] = evaluate.thresholds_fitted_on_train(args.preset, args.n, args.seed)
        th, info = cache["train"]
        row = {"z_min": th.z_min, "min_gain": th.min_gain, "fitted_on": info["train_tasks"]}
        return [row] * len(tasks), {"protocol": "fit-on-train", **info}
    traces, _, _ = evaluate.trace_all(tasks)
    folds = evaluate.loo_folds(tasks, traces, THRESHOLD_GRID)
    rows: list[dict | None] = [None] * len(tasks)
    info = {"protocol": "loo", "folds": {}}
    for mix, fold in folds.items():
        th = fold["thresholds"]
        row = {"z_min": th.z_min, "min_gain": th.min_gain, "fitted_on": [tasks[i].id for i in fold["rest"]]}
        for i in fold["held"]:
            rows[i] = row
        info["folds"][mix] = {"thresholds": th.__dict__, "rest_successes": fold["rest_successes"],
                              "rest_n": len(fold["rest"])}
    return rows, info


def environment(task, xrd: ConfiguredEnv, cfg, threshold: dict | None):
    """The task's XRDEnv, its fit_phases at the protocol's threshold (None: the a-priori one)."""
    env = xrd.environment(task, cfg)
    if threshold is not None:
        env.ctx.detection_z_min = threshold["z_min"]
    return env


def episode_generate(client, task, tokenizer, cfg) -> dict:
    t = run_episode(client, task, tokenizer, cfg, replay="off")
    f1, mae = _grade_numbers(t.metadata.get("grade"))
    return {"task_id": t.task_id, "success": t.rewards["success"], "dense": t.rewards["dense"],
            "turns": t.metadata["turns"], "tokens": t.num_tokens, "gen_tokens": t.num_generated,
            "phase_f1": f1, "weight_mae": mae, "finish": t.metadata["finish"],
            "answer": t.metadata["answer"], "tool_calls": t.metadata["tool_calls"],
            "tool_errors": t.metadata["tool_errors"], "malformed_calls": t.metadata["malformed_calls"],
            "episode_s": t.timings.get("episode_s")}


def episode_chat(client, task, cfg) -> dict:
    env = as_environment(task, cfg)      # an XRDEnv (see environment())
    t0 = time.monotonic()
    ep = ChatEpisode(client, env, cfg).run()
    predicted = env.parse_answer(ep.answer_text) if ep.answer_text is not None else None
    success, dense, details = env.grade(predicted)
    f1, mae = _grade_numbers(details)
    return {"task_id": env.task_id, "success": float(success), "dense": float(dense),
            "turns": sum(1 for m in ep.messages if m["role"] == "assistant"), "tokens": ep.tokens,
            "gen_tokens": ep.gen_tokens, "phase_f1": f1, "weight_mae": mae, "finish": ep.finish,
            "answer": ep.answer_text, **ep.counts, "episode_s": time.monotonic() - t0}


def judge_panel(judges: list[str], record: dict, truth_text: str, api_key: str | None) -> int | None:
    """Majority vote of LLM judges on one answer; None when no judge could answer."""
    prompt = ("You grade powder XRD phase analysis. Ground truth (phases and weight fractions): "
              f"{truth_text}\nPredicted answer: {record.get('answer')!r}\nSuccess means every true "
              "phase of at least 5 wt% is named, no phase of at least 5 wt% is spurious, and every "
              "fraction is within 10 wt%. Reply with exactly YES or NO.")
    votes = []
    for spec in judges:
        url, _, model = spec.partition("=")
        try:
            resp = ChatClient(url, model or "default", api_key=api_key).complete(
                [{"role": "user", "content": prompt}], max_tokens=4, temperature=0.0)
            text = ((resp.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
            votes.append(1 if text.strip().upper().startswith("YES") else 0)
        except Exception as e:  # noqa: BLE001 - a judge failing must not stop the evaluation
            print(f"judge {spec}: {e}", file=sys.stderr)
    return None if not votes else int(sum(votes) * 2 > len(votes))


def truth_text(task: Any) -> str:
    truth = getattr(task, "truth", None)
    try:
        return json.dumps(truth, default=lambda o: getattr(o, "__dict__", repr(o)))
    except (TypeError, ValueError):
        return repr(truth)


def run_split(args, split: str, cfg: RolloutConfig, xrd: ConfiguredEnv, api: str,
              cache: dict | None = None) -> tuple[list[dict], dict]:
    tasks = load_split_tasks(args, split)
    thresholds, info = protocol_thresholds(args, tasks, {} if cache is None else cache)
    threshold_of = {id(t): th for t, th in zip(tasks, thresholds)}
    if api == "generate":
        # deferred: heavy (neon_hpc.rollout.engines.client: httpx)
        from neon_hpc.rollout.engines.client import EngineClient
        client, tok = EngineClient(args.endpoint), load_tokenizer(args.tokenizer)
        work = lambda task: episode_generate(client, task, tok, cfg)
    else:
        client = ChatClient(args.endpoint, args.model, api_key=args.api_key, retries=args.retries)
        work = lambda task: episode_chat(client, task, cfg)

    def one(task):
        threshold = threshold_of[id(task)]
        try:
            rec = work(environment(task, xrd, cfg, threshold))
        except Exception as e:  # noqa: BLE001 - one failed episode is a recorded failure, not a crash
            rec = {"task_id": str(getattr(task, "task_id", getattr(task, "id", "?"))), "success": 0.0,
                   "dense": 0.0, "turns": 0, "tokens": 0, "gen_tokens": 0, "phase_f1": None,
                   "weight_mae": None, "error": f"{type(e).__name__}: {e}"}
        if args.judge:
            rec["judge"] = judge_panel(args.judge, rec, truth_text(task), args.api_key)
        rec["split"] = split
        rec["detection_z_min"] = threshold["z_min"] if threshold else None
        if threshold:
            rec["thresholds_fitted_on"] = threshold["fitted_on"]
        return rec

    records = []
    bar = None
    if not args.no_progress:
        from tqdm import tqdm  # deferred: heavy (tqdm)
        bar = tqdm(total=len(tasks), desc=f"eval {split}", file=sys.stderr, unit="ep")
    with ThreadPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        for fut in as_completed([pool.submit(one, t) for t in tasks]):
            records.append(fut.result())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(success=f"{sum(r['success'] for r in records) / len(records):.2f}")
    if bar is not None:
        bar.close()
    return sorted(records, key=lambda r: r["task_id"]), info


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, xrd = rollout_config(args), PLUGIN.bind(xrd_settings(args))
    splits = [s.strip() for s in args.split.split(",") if s.strip()]
    for s in splits:
        if s not in SPLITS + ("real",):
            print(f"neon-hpc xrd eval: unknown split {s!r}; choose from {', '.join(SPLITS)}, real",
                  file=sys.stderr)
            return 2
    why = protocol_error(args.protocol, splits)
    if why:
        print(f"neon-hpc xrd eval: {why}", file=sys.stderr)
        return 2
    api = detect_api(args.endpoint) if args.api == "auto" else args.api
    why = reachable(args.endpoint, api)
    if why:
        print(f"neon-hpc xrd eval: cannot reach {args.endpoint} ({why}); is the server up?", file=sys.stderr)
        return 2
    summaries, records, protocol = {}, [], {}
    cache: dict = {}
    for split in splits:
        recs, protocol[split] = run_split(args, split, cfg, xrd, api, cache)
        summaries[split] = summarize(recs)
        records += recs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"endpoint": args.endpoint, "model": args.model, "api": api, "preset": args.preset,
            "tools": args.tools, "seed": args.seed, "n": args.n, "temperature": args.temperature,
            "protocol": args.protocol}
    atomic_write_json(out / "eval.json", {"meta": meta, "summaries": summaries, "protocol": protocol,
                                          "episodes": records})
    md = (f"# XRD eval: {args.model} ({api} API, tools={args.tools}, preset={args.preset}, "
          f"protocol={args.protocol})\n\n"
          + markdown_table(summaries))
    atomic_write_text(out / "eval.md", md)
    print(md)
    print(f"wrote {out / 'eval.json'} and {out / 'eval.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
