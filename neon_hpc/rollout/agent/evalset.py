"""A fixed eval set on published weights: greedy episodes of held-out tasks, graded.

``evaluate_weights(weights_dir, tasks, tokenizer, rollout_cfg, model_cfg, env=envs.configured(cfg))``
serves the folder (``weights/v_N``, HF safetensors as the trainer publishes them) on an embedded
engine in this process and plays one episode per task through the agent loop (:func:`run_episode`: the same
template, tools, limits and forced answer as the RL rollouts) at temperature 0, so the same
weights on the same tasks give the same answers. Routes are not requested (nothing trains on
these episodes). The tasks come from the environment's task source (``env.kind``'s plugin,
``neon_hpc/envs/``): ``eval.num_tasks`` held-out tasks of ``eval.split`` (one of the environment's
held-out splits: never the train tasks RL samples) with ``eval.seed`` (:func:`eval_tasks`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from neon_hpc.envs.base import ConfiguredEnv, TaskSource
from neon_hpc.rollout.agent.group import run_episode
from neon_hpc.rollout.engines.client import EngineClient


def eval_tasks(eval_cfg: Any, source: TaskSource) -> list:
    """The eval set: ``eval.num_tasks`` held-out tasks of ``eval.split`` and ``eval.seed`` from ``source``."""
    return source.held_out(eval_cfg.split, eval_cfg.num_tasks, eval_cfg.seed)


def greedy(rollout_cfg: Any) -> Any:
    """The rollout section with temperature 0 (greedy); :func:`evaluate_weights` exports no routes."""
    return dataclasses.replace(rollout_cfg, temperature=0.0, top_p=1.0)


def evaluate_weights(weights_dir: str | Path, tasks: list, tokenizer: Any, rollout_cfg: Any, model_cfg: Any,
                     *, env: ConfiguredEnv, concurrency: int = 16) -> dict:
    """Success and dense reward of greedy episodes of ``tasks`` (environments by ``env``) on the weights in
    ``weights_dir``."""
    # deferred: heavy (neon_hpc.rollout.engines.embedded: torch; importing this module does not load it)
    from neon_hpc.rollout.engines.embedded import start_server

    if not tasks:
        raise ValueError("evaluate_weights: no tasks (eval.num_tasks is 0)")
    cfg = greedy(rollout_cfg)
    t0, c0 = time.monotonic(), time.process_time()
    with start_server(weights_dir, in_process=True, max_batch_size=max(1, min(concurrency, len(tasks)))) as h:
        client = EngineClient(h.url, num_moe_layers=model_cfg.num_layers, top_k=model_cfg.moe_router_topk)
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(tasks)))) as pool:
            trajs = list(pool.map(lambda t: run_episode(client, t, tokenizer, cfg, env=env, replay="off"), tasks))
    per_task = [{"task_id": t.task_id, "success": t.rewards["success"], "dense": t.rewards["dense"],
                 "answer": t.metadata.get("answer"), "finish": t.metadata.get("finish"),
                 "tool_calls": t.metadata.get("tool_calls")} for t in trajs]
    return {"weights": str(weights_dir), "n": len(trajs), "temperature": 0.0,
            "success": float(np.mean([p["success"] for p in per_task])),
            "dense": float(np.mean([p["dense"] for p in per_task])),
            "success_se": float(np.std([p["success"] for p in per_task]) / np.sqrt(len(per_task))),
            "wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - c0, "tasks": per_task}
