"""``neon-hpc status RUN``: one screen on a live or finished run, for operators.

Reads only the run directory (and asks Slurm about the job id recorded there), so it works
from any login node while the job runs, and after it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import asdict
from typing import Any

from neon_hpc.launch.slurmjob import SlurmUnavailable, query
from neon_hpc.launch.summary import trained_versions_and_waste, trainer_steps
from neon_hpc.protocol.journal import journal_summary
from neon_hpc.protocol.records import EngineRecord, Finished, JobRecord
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.store import run_store
from neon_hpc.util.logs import read_metrics


def slurm_state(job_id: str) -> tuple[str, dict[str, str]]:
    """The job's state and every component's (a heterogeneous job has several), from
    ``launch.slurmjob``; ``("", {})`` when Slurm is not reachable."""
    try:
        job = query(job_id, timeout=10)
    except SlurmUnavailable:
        return "", {}
    return job.state, dict(job.components)


def shard_counts(run: RunDir) -> dict[str, int]:
    """The run's store's shard counts: ready, claimed, quarantined, writing."""
    return asdict(run_store(run).counts())


_ERR = re.compile(r"\b(ERROR|CRITICAL|Traceback)\b")


def last_errors(run: RunDir, n: int = 5) -> list[str]:
    """The newest error lines across all role logs (by file order within each log)."""
    found: list[tuple[float, str]] = []
    for log in sorted(run.logs.glob("*/*.log")):
        try:
            lines = log.read_text(errors="replace").splitlines()[-2000:]
        except OSError:
            continue
        mtime = log.stat().st_mtime
        hits = [l for l in lines if _ERR.search(l)]
        for i, l in enumerate(hits[-n:]):
            found.append((mtime + i * 1e-6, f"{log.parent.name}/{log.name}: {l.strip()[:200]}"))
    return [l for _, l in sorted(found)[-n:]]


def collect(run_dir: str | os.PathLike) -> dict[str, Any]:
    run = RunDir(run_dir)
    run.check()
    rec = JobRecord.read(run)
    job = rec.to_json() if rec else {}
    trainer = read_metrics(run.root, "trainer")
    rollout = [r for r in read_metrics(run.root, "rollout") if "event" not in r]
    latest = run.latest_weights()
    slurm = slurm_state(str(job["job_id"])) if job.get("job_id") and job.get("backend") == "slurm" else ("", {})
    info: dict[str, Any] = {
        "run": str(run.root),
        "job": job,
        "slurm_state": slurm[0],
        "slurm_components": slurm[1],
        "trainer_step": trainer[-1]["step"] if trainer else None,
        "checkpoint": run.latest_checkpoint(),
        "weights_latest": latest[0] if latest else None,
        "heartbeats": run.heartbeats(),
        "shards": shard_counts(run),
        "trajectories_written": len(rollout),
        # trajectories a claim skipped because their uid had been consumed (a shard published twice)
        "duplicates_skipped": sum(int(r.get("duplicates_skipped", 0)) for r in trainer_steps(trainer)),
        "staleness_hist": trainer[-1].get("staleness_hist", {}) if trainer else {},
        **trained_versions_and_waste(trainer),
        "trainer_tokens_per_s": _rate(trainer, "tokens"),
        "rollout_tokens_per_s": _rate(rollout, "tokens"),
        "reward_last": trainer[-1].get("reward_mean") if trainer else None,
        "finished": (lambda f: f.to_json() if f else None)(Finished.read(run)),
        "errors": last_errors(run),
        "engines": [e.to_json() for e in EngineRecord.read_all(run)],
        "journal": journal_summary(run),
    }
    return info


def _rate(records: list[dict], key: str, window_s: float = 120.0) -> float | None:
    if len(records) < 2:
        return None
    t_end = records[-1]["time"]
    recent = [r for r in records if r["time"] >= t_end - window_s]
    if len(recent) < 2:
        recent = records[-2:]
    dt = recent[-1]["time"] - recent[0]["time"]
    return sum(r.get(key, 0) for r in recent[1:]) / dt if dt > 0 else None


def render(info: dict[str, Any]) -> str:
    lines = [f"run       {info['run']}"]
    job = info["job"]
    if job:
        state = info["slurm_state"] or ("finished" if info["finished"] else "running?")
        lines.append(f"job       {job.get('job_id', '-')} ({job.get('backend', '?')}) state={state}")
        comps = info.get("slurm_components") or {}
        if len(comps) > 1:   # a heterogeneous job: each component (rollout group, trainer group)
            lines.append("          " + " ".join(f"{c}={s}" for c, s in comps.items()))
    lines.append(f"trainer   step={_fmt(info['trainer_step'])} checkpoint=step_{_fmt(info['checkpoint'])} "
                 f"weights=v_{_fmt(info['weights_latest'])} reward={_fmt(info['reward_last'])}")
    s = info["shards"]
    lines.append(f"shards    ready={s['ready']} claimed={s['claimed']} quarantined={s['quarantined']} "
                 f"writing={s['writing']}  trajectories written={info['trajectories_written']}"
                 + ("  duplicates skipped=" + str(info["duplicates_skipped"])
                    if info.get("duplicates_skipped") else ""))
    lines.append(f"tokens/s  trainer={_fmt(info['trainer_tokens_per_s'])} rollout={_fmt(info['rollout_tokens_per_s'])}")
    if info["staleness_hist"]:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(info["staleness_hist"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"staleness {hist}   (trainer version - token version: token count)")
    if info.get("trained_versions_spanned"):
        spans = " ".join(f"{k}:{v}" for k, v in info["trained_versions_spanned"].items())
        lines.append(f"versions  {spans}   (versions spanned: trained trajectories)")
    if info.get("wasted_rollout_tokens") is not None:
        lines.append(f"wasted    {info['wasted_rollout_tokens']:.3f} of generated tokens (stale: "
                     f"{info['masked_stale_tokens']} masked, {info['dropped_stale_tokens']} dropped)")
    j = info.get("journal") or {}
    if j.get("episodes") or j.get("quarantined") or j.get("unreadable"):
        lines.append(f"journal   {j['episodes']} episodes in {j['groups']} groups ({j['done']} done, waiting for "
                     f"their group): {j['turns']} turns, {j['tokens']} tokens ({j['gen_tokens']} generated), "
                     f"oldest version v_{_fmt(j['oldest_version'])}"
                     + (f"; {j['quarantined']} quarantined" if j.get("quarantined") else "")
                     + (f"; {j['unreadable']} unreadable" if j.get("unreadable") else ""))
    serving = [(i, e) for i, e in enumerate(info.get("engines", [])) if e.get("urls")]
    if serving:
        lines.append("engines   " + "; ".join(
            f"node {i}: {' '.join(e['urls'])} ({e.get('kind', 'embedded')}, v_{e.get('version', '?')})"
            for i, e in serving) +
            (f"; workers via {serving[0][1]['workers_url']}" if serving[0][1].get("workers_url") else ""))
    lines.append("heartbeats")
    now_note = "" if not info["finished"] else " (run finished: ages are expected to grow)"
    for hb in info["heartbeats"]:
        extra = " ".join(f"{k}={v}" for k, v in hb.items()
                         if k not in ("role", "rank", "time", "pid", "host", "age_s")
                         and not isinstance(v, (dict, list)))
        flag = "  STALE" if hb["age_s"] > 120 and not info["finished"] else ""
        lines.append(f"  {hb['role']:<8} {str(hb['rank']):<4} age={hb['age_s']:6.1f}s host={hb.get('host')} "
                     f"pid={hb.get('pid')} {extra}{flag}")
    if not info["heartbeats"]:
        lines.append("  (none yet)")
    lines[-1] += now_note if info["heartbeats"] else ""
    if info["errors"]:
        lines.append("last errors")
        lines += [f"  {e}" for e in info["errors"]]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc status", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="refresh every N seconds")
    a = p.parse_args(argv)
    while True:
        info = collect(a.run_dir)
        out = json.dumps(info, indent=1, default=str) if a.json else render(info)
        if a.watch:
            print("\033[2J\033[H" + time.strftime("%H:%M:%S ") + out, flush=True)
            time.sleep(a.watch)
        else:
            print(out)
            return 0
