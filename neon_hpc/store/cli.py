"""``neon-hpc shard``: look at trajectory shards and at a run's trajectory directories.

    neon-hpc shard inspect PATH [--index I] [--json]   summary, table, one trajectory
    neon-hpc shard verify PATH...                      validate; exit 1 if any fails
    neon-hpc shard ls RUN                              ready / claimed / quarantine counts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from neon_hpc.protocol.records import ClaimRecord
from neon_hpc.protocol.rundir import RunDir, RunDirError
from neon_hpc.store.claim import REASON_SUFFIX, claimed_steps, ready_count
from neon_hpc.store.reader import ShardError, read_shard, shard_summary
from neon_hpc.store.trajectory import Trajectory


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _summary_lines(s: dict) -> list[str]:
    a = s["attrs"]
    out = [f"shard      {s['path']}",
           f"file       {_mb(s['file_bytes'])}",
           f"schema     {a.get('format')!s} v{a.get('schema_version')}",
           f"writer     {a.get('writer_id')} (job {a.get('job_id')})",
           f"created    {a.get('created')}",
           f"contents   {a.get('num_trajectories')} trajectories, {a.get('num_tokens')} tokens",
           f"checksum   {a.get('checksum')}",
           "datasets:"]
    for name, d in sorted(s["datasets"].items()):
        comp = f" {d['compression']}" if d["compression"] else ""
        out.append(f"  {name:<15} {str(tuple(d['shape'])):<22} {d['dtype']}{comp}")
    return out


def _table_lines(trajs: list[Trajectory], limit: int = 20) -> list[str]:
    out = [f"  {'#':>4} {'task_id':<20} {'group_id':<14} {'tokens':>7} {'gen':>6} {'versions':>10} {'reward':>8}"]
    for i, t in enumerate(trajs[:limit]):
        vmin, vmax = t.version_range()
        out.append(f"  {i:>4} {t.task_id[:20]:<20} {t.group_id[:14]:<14} {t.num_tokens:>7} "
                   f"{t.num_generated:>6} {f'{vmin}..{vmax}':>10} {t.reward:>8.3g}")
    if len(trajs) > limit:
        out.append(f"  ... {len(trajs) - limit} more")
    return out


def _detail_lines(i: int, t: Trajectory) -> list[str]:
    def head(a, k=16):
        a = np.asarray(a)
        return np.array2string(a[:k], max_line_width=200) + (" ..." if len(a) > k else "")

    routes = "none" if t.routed_experts is None else \
        f"{tuple(t.routed_experts.shape)} {t.routed_experts.dtype}; token 0: {t.routed_experts[:1].tolist()}"
    return [f"trajectory {i}: task_id={t.task_id!r} group_id={t.group_id!r}",
            f"  tokens       {head(t.tokens)}",
            f"  loss_mask    {head(t.loss_mask)}",
            f"  logprobs     {head(t.logprobs, 8)}",
            f"  versions     {head(t.versions)}",
            f"  turn_offsets {t.turns().tolist()}",
            f"  routes       {routes}",
            f"  reward       {t.reward}  rewards={json.dumps(t.rewards)}  advantage={t.advantage}",
            f"  metadata     {json.dumps(t.metadata)[:300]}",
            f"  timings      {json.dumps(t.timings)}"]


def cmd_inspect(a: argparse.Namespace) -> int:
    try:
        s = shard_summary(a.path)
    except (ShardError, FileNotFoundError) as e:
        print(f"neon-hpc shard inspect: {e}", file=sys.stderr)
        return 1
    try:
        trajs, error = read_shard(a.path), None
    except ShardError as e:
        trajs, error = [], e.reason
    if a.json:
        s["valid"], s["error"] = error is None, error
        s["trajectories"] = [{"task_id": t.task_id, "group_id": t.group_id, "tokens": t.num_tokens,
                              "generated": t.num_generated, "version_range": list(t.version_range()),
                              "reward": t.reward} for t in trajs]
        print(json.dumps(s, indent=1, default=str))
        return 0 if error is None else 1
    lines = _summary_lines(s)
    if error is not None:
        lines.append(f"INVALID: {error}")
        print("\n".join(lines))
        return 1
    lines.append("valid: schema, shapes, offsets and checksums check out")
    lines += _table_lines(trajs)
    if trajs:
        if not 0 <= a.index < len(trajs):
            print(f"neon-hpc shard inspect: --index {a.index} out of range 0..{len(trajs) - 1}", file=sys.stderr)
            return 2
        lines += _detail_lines(a.index, trajs[a.index])
    print("\n".join(lines))
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    bad = 0
    for p in a.paths:
        try:
            trajs = read_shard(p)
            print(f"ok       {p} ({len(trajs)} trajectories)")
        except (ShardError, FileNotFoundError) as e:
            bad += 1
            print(f"INVALID  {e}")
    return 1 if bad else 0


def cmd_ls(a: argparse.Namespace) -> int:
    rd = RunDir(a.run)
    if not rd.traj.is_dir():
        print(f"neon-hpc shard ls: {rd.traj} does not exist; is {rd.root} a run directory?", file=sys.stderr)
        return 2
    shards, trajs = ready_count(rd)
    print(f"ready       {shards} shards, {trajs} trajectories")
    steps = claimed_steps(rd)
    print(f"claimed     {len(steps)} committed steps" + (f" ({steps[0]}..{steps[-1]})" if steps else ""))
    for s in steps[-a.last:]:
        try:
            rec = ClaimRecord.read(rd, s)
        except RunDirError as e:     # a torn or foreign record: say so, list the rest
            print(f"  step_{s:<6} {e}")
            continue
        if rec is None:              # committed a moment ago and gone since (moved aside)
            continue
        print(f"  step_{s:<6} {rec.trajectories} trajectories, {rec.tokens} tokens, "
              f"{len(rec.shards)} shards, {rec.dropped_stale} stale dropped, "
              f"{len(rec.duplicates)} duplicates skipped, by {rec.consumer}")
    q = rd.traj_quarantine
    names = sorted(n for n in os.listdir(q) if not n.endswith(REASON_SUFFIX)) if q.is_dir() else []
    print(f"quarantine  {len(names)} files")
    for n in names:
        reason_file = q / f"{n}{REASON_SUFFIX}"
        reason = reason_file.read_text().splitlines()[0] if reason_file.exists() else "(no reason file)"
        print(f"  {n}: {reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neon-hpc shard", description="inspect trajectory shards")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect", help="print a shard's summary, a table and one trajectory")
    i.add_argument("path", type=Path)
    i.add_argument("--index", type=int, default=0, help="which trajectory to print in full (default 0)")
    i.add_argument("--json", action="store_true", help="machine-readable summary")
    i.set_defaults(fn=cmd_inspect)
    v = sub.add_parser("verify", help="validate shards (schema, shapes, offsets, checksums)")
    v.add_argument("paths", nargs="+", type=Path)
    v.set_defaults(fn=cmd_verify)
    ls = sub.add_parser("ls", help="counts of a run's ready, claimed and quarantined shards")
    ls.add_argument("run", type=Path)
    ls.add_argument("--last", type=int, default=5, help="claimed steps to list (default 5)")
    ls.set_defaults(fn=cmd_ls)
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
