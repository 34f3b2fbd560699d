"""The main job's warm start and its eval: demonstrations -> SFT -> (RL) -> greedy eval before/after.

``neon-hpc run`` with ``warm_start.enabled`` (``configs/tiny_cpu.yaml``):

1. ``RUN/warm_start/demos/``: demonstrations of ``warm_start.demos`` train-split tasks, written by
   the environment's plugin (``env.kind``; XRD's: ``neon_hpc.envs.xrd.demos``; ``demos.json``
   records their summary and marks them done).  An environment without demonstrations has no
   warm start: the main job says so and RL starts from ``model.init_checkpoint`` (or from scratch);
2. ``RUN/warm_start/``: an SFT run of the same trainer (``train.mode: sft``, its own
   ``run.yaml``: the run's config with ``warm_start.steps / trajectories_per_step / lr``), as
   ``world_size`` local trainer processes; it checkpoints and publishes at its last step;
3. the RL run's ``model.init_checkpoint`` is ``RUN/warm_start/checkpoints/step_<warm_start.steps>``
   (set before ``run.yaml`` is written, so a resumed run reads the same), and RL starts from it.

A run directory whose warm start is complete reuses it (nothing is recomputed); a half-done SFT
resumes from its newest checkpoint like any trainer run.

After RL, :func:`evaluate_run` plays ``eval.num_tasks`` held-out tasks (the plugin's task source) greedily on
the weights RL started from (``weights/v_0``: the SFT weights when there is a warm start) and on the last
published ones (``RUN/eval/start.json``, ``RUN/eval/end.json``; the same tasks, temperature 0),
and :func:`write_summary` writes ``RUN/summary.json``.

``neon-hpc sft CONFIG [--run-dir RUN]`` runs steps 1-2 alone and prints the checkpoint to use as
``model.init_checkpoint``.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from neon_hpc import config, envs
from neon_hpc.config.launch import thread_env, trainer_threads
from neon_hpc.config.train import world_size
from neon_hpc.launch.common import resolve_run_dir
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.protocol.rundir import RunDir, atomic_write_json, atomic_write_text, read_json
from neon_hpc.rollout.agent.evalset import eval_tasks, evaluate_weights
from neon_hpc.util.logs import read_metrics
from neon_hpc.util.netutil import free_port

WARM = "warm_start"
SUMMARY = "summary.json"


class WarmStartError(RuntimeError):
    """The warm start failed; the message names the log to read."""


def warm_dir(run_root: str | os.PathLike) -> Path:
    return Path(run_root) / WARM


def sft_checkpoint(cfg: config.ExperimentConfig, run_root: str | os.PathLike) -> Path:
    return warm_dir(run_root) / "checkpoints" / f"step_{cfg.warm_start.steps}"


def has_warm_start(cfg: config.ExperimentConfig) -> bool:
    """``warm_start.enabled`` and the environment (``env.kind``) provides demonstrations."""
    return cfg.warm_start.enabled and envs.get(cfg.env.kind).write_demos is not None


def no_warm_start_note(cfg: config.ExperimentConfig) -> str:
    return (f"warm start: skipped, environment {cfg.env.kind!r} provides no demonstrations; RL starts from "
            f"{cfg.model.init_checkpoint or 'freshly initialised weights'}")


def apply_warm_start(cfg: config.ExperimentConfig, run_root: str | os.PathLike) -> config.ExperimentConfig:
    """With a warm start (:func:`has_warm_start`) and no ``model.init_checkpoint`` of its own: RL starts from
    the SFT checkpoint."""
    if has_warm_start(cfg) and not cfg.model.init_checkpoint:
        cfg.model.init_checkpoint = str(sft_checkpoint(cfg, Path(run_root).absolute()))
    return cfg


def sft_config(cfg: config.ExperimentConfig, wdir: Path) -> config.ExperimentConfig:
    """The SFT run's config: the run's, with the warm start's steps, batch and learning rate."""
    s = copy.deepcopy(cfg)
    ws = cfg.warm_start
    s.run_dir = str(wdir)
    s.model.init_checkpoint = ""
    s.train.mode = "sft"
    s.train.sft_data = str(wdir / "demos")
    s.train.steps = ws.steps
    s.train.trajectories_per_step = ws.trajectories_per_step
    s.train.lr = ws.lr
    s.train.checkpoint_every = ws.steps
    s.train.publish_every = ws.steps
    s.warm_start.enabled = False
    return s


def _complete(ckpt: Path) -> bool:
    return (ckpt / "trainer_state.json").is_file()


def ensure_demos(cfg: config.ExperimentConfig, wdir: Path, say: Callable[[str], None]) -> dict:
    done = wdir / "demos" / "demos.json"
    if done.is_file():
        return {**read_json(done), "reused": True}
    env = envs.configured(cfg)
    if env.plugin.write_demos is None:
        raise WarmStartError(f"environment {cfg.env.kind!r} provides no demonstrations: set warm_start.enabled: false")
    t0 = time.monotonic()
    source = env.tasks()
    tasks = source.demo(cfg.warm_start.demos)
    tok = load_tokenizer(cfg.model.tokenizer_source)
    s = env.write_demos(wdir / "demos", tasks, tok, cfg.rollout, cfg.warm_start.imperfect, source.seed)
    s["wall_s"] = time.monotonic() - t0
    atomic_write_json(done, s)
    say(f"warm start: {s['demos']} demonstrations of train tasks ({s['count_by_kind']}), grader success "
        f"{s['success']:.2f} ({s['success_by_kind']}), {s['wall_s']:.0f}s")
    return {**s, "reused": False}


def ensure_sft(cfg: config.ExperimentConfig, wdir: Path, say: Callable[[str], None]) -> dict:
    ckpt = sft_checkpoint(cfg, wdir.parent)
    if _complete(ckpt):
        return {"checkpoint": str(ckpt), "reused": True, **_sft_losses(wdir)}
    scfg = sft_config(cfg, wdir)
    run = RunDir(wdir).create()
    atomic_write_text(run.run_yaml, config.dump(scfg))
    world, port = world_size(scfg), str(free_port())
    log_dir = run.log_dir("trainer")
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONUNBUFFERED="1", RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   **thread_env(trainer_threads(len(os.sched_getaffinity(0)), world, beside_rollout=False)))
        out = open(log_dir / f"{r}.stderr", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "neon_hpc.train", "--config", str(run.run_yaml),
                                       "--run-dir", str(wdir)], stdout=out, stderr=out, env=env))
    say(f"warm start: SFT, {scfg.train.steps} steps of {scfg.train.trajectories_per_step} demonstrations "
        f"(lr {scfg.train.lr}), {world} trainer rank(s); log: {log_dir / '0.stderr'}")
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes) or not _complete(ckpt):
        raise WarmStartError(f"the SFT trainer exited {codes} without {ckpt}; its log: {log_dir / '0.stderr'}")
    s = {"checkpoint": str(ckpt), "reused": False, "wall_s": time.monotonic() - t0, **_sft_losses(wdir)}
    say(f"warm start: SFT loss {s['sft_loss_first']:.3f} -> {s['sft_loss_last']:.3f} in {s['wall_s']:.0f}s; "
        f"RL starts from {ckpt}")
    return s


def _sft_losses(wdir: Path) -> dict:
    recs = [r for r in read_metrics(wdir, "trainer") if r.get("mode") == "sft"]
    if not recs:
        return {"sft_loss_first": None, "sft_loss_last": None}
    return {"sft_loss_first": recs[0].get("loss"), "sft_loss_last": recs[-1].get("loss"), "sft_steps": len(recs)}


def run_warm_start(cfg: config.ExperimentConfig, run_root: str | os.PathLike, say: Callable[[str], None]) -> dict:
    """Demonstrations then SFT into ``RUN/warm_start`` (reused when complete); a summary dict."""
    wdir = warm_dir(Path(run_root).absolute())
    wdir.mkdir(parents=True, exist_ok=True)
    if _complete(sft_checkpoint(cfg, wdir.parent)):
        say(f"warm start: reusing {sft_checkpoint(cfg, wdir.parent)}")
        return {"demos": read_json(wdir / "demos" / "demos.json", {}), **ensure_sft(cfg, wdir, say)}
    return {"demos": ensure_demos(cfg, wdir, say), **ensure_sft(cfg, wdir, say)}


# --------------------------------------------------------------------------------------
# eval before / after, and RUN/summary.json

def evaluate_run(cfg: config.ExperimentConfig, run: RunDir, say: Callable[[str], None]) -> dict:
    """Greedy eval of ``weights/v_0`` (start of RL) and the newest published weights (end), cached in ``RUN/eval``."""
    if cfg.eval.num_tasks <= 0:
        return {}
    versions = sorted(run.weight_versions())
    if not versions:
        say("eval: no published weights; skipped")
        return {}
    env = envs.configured(cfg)
    source = env.tasks()
    tasks = eval_tasks(cfg.eval, source)
    tok = load_tokenizer(cfg.model.tokenizer_source)
    out = {}
    for which, v in (("start", versions[0]), ("end", versions[-1])):
        path = run.root / "eval" / f"{which}.json"
        prev = read_json(path)
        if prev and prev.get("version") == v and prev.get("n") == len(tasks):
            out[which] = prev
            continue
        res = evaluate_weights(run.weights_version(v), tasks, tok, cfg.rollout, cfg.model, env=env)
        res.update(version=v, split=cfg.eval.split, seed=cfg.eval.seed, preset=source.label)
        atomic_write_json(path, res)
        out[which] = res
        say(f"eval ({which} of RL, weights v_{v}): success {res['success']:.3f} (dense {res['dense']:.3f}) on "
            f"{res['n']} held-out {source.label}/{cfg.eval.split} tasks, greedy, {res['wall_s']:.0f}s")
    return out


def write_summary(run: RunDir, s: dict, ev: dict, warm: dict | None, cpu: dict) -> dict:
    """``RUN/summary.json``: the launcher's summary plus the eval and warm start figures."""
    start, end = ev.get("start") or {}, ev.get("end") or {}
    out = dict(s)
    out.update(eval_success_start=start.get("success"), eval_success_end=end.get("success"),
               eval_dense_start=start.get("dense"), eval_dense_end=end.get("dense"),
               eval_version_start=start.get("version"), eval_version_end=end.get("version"),
               eval_tasks=end.get("n"), trained_spanning_ge2=s.get("trained_multi_version_fraction"),
               warm_start=warm or None, **cpu)
    atomic_write_json(run.root / SUMMARY, out)
    return out


def cpu_seconds() -> dict:
    """CPU seconds of this process and its reaped children (user + system)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu_s_launcher": me.ru_utime + me.ru_stime, "cpu_s_children": kids.ru_utime + kids.ru_stime}


def main(argv: list[str]) -> int:
    """``neon-hpc sft CONFIG [--run-dir RUN] [--set k=v ...]``: the warm start alone."""
    p = argparse.ArgumentParser(prog="neon-hpc sft", description="demonstrations + SFT (the main job's warm "
                                "start) into RUN/warm_start; prints the checkpoint for model.init_checkpoint")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    cfg = config.load(a.config or str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"), a.set)
    root = resolve_run_dir(cfg, a.run_dir)
    try:
        s = run_warm_start(cfg, root, lambda m: print(m, flush=True))
    except WarmStartError as e:
        print(f"neon-hpc sft: {e}", file=sys.stderr)
        return 2
    print(f"model.init_checkpoint: {s['checkpoint']}")
    return 0
