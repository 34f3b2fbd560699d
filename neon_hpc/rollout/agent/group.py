"""Entry points: one episode, or a GRPO group of episodes on one task."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from neon_hpc.envs.base import ConfiguredEnv
from neon_hpc.rollout.agent.episode import REPLAY_DEFAULT, Episode


def as_environment(task: Any, cfg: Any, env: ConfiguredEnv | None = None):
    """The episode's environment: an object that already is one passes; a task becomes one through
    its plugin bound to the plugin's config section, ``env`` (:func:`neon_hpc.envs.configured` of the
    experiment config: ``env.kind`` and its settings, the ``env:`` section)."""
    if hasattr(task, "run_tool") and hasattr(task, "grade"):
        return task
    if env is None:
        raise TypeError(f"{type(task).__name__} {getattr(task, 'id', '')!s} is a task, not an environment: "
                        f"pass env=neon_hpc.envs.configured(cfg) (the config's env.kind and its section) "
                        f"to build its environment")
    return env.environment(task, cfg)


def run_episode(client: Any, task: Any, tokenizer: Any, cfg: Any,
                version_of: Callable[[str], int] = int, group_id: str = "", seed: int | None = None,
                env: ConfiguredEnv | None = None, replay: str = REPLAY_DEFAULT):
    """Run one episode against an SGLang-compatible engine client; returns a ``Trajectory``.
    ``replay``: the routes the engine exports (``offpolicy.replay_engine``)."""
    ep = Episode(client, as_environment(task, cfg, env), tokenizer, cfg, version_of=version_of, seed=seed,
                 replay=replay).run()
    return ep.trajectory(group_id=group_id, reward_key=getattr(cfg, "reward", "dense"))


def run_group(client: Any, task: Any, tokenizer: Any, cfg: Any, group_size: int | None = None,
              version_of: Callable[[str], int] = int, seed: int | None = None,
              env: ConfiguredEnv | None = None, replay: str = REPLAY_DEFAULT) -> list:
    """``group_size`` episodes of one task, concurrently (the engine batches them), one group id."""
    g = cfg.group_size if group_size is None else group_size
    if g < 1:
        raise ValueError(f"group_size must be >= 1, got {g}")
    group_id = uuid.uuid4().hex[:16]
    seeds = [None if seed is None else seed + 1000 * i for i in range(g)]
    with ThreadPoolExecutor(max_workers=g) as pool:
        futs = [pool.submit(run_episode, client, task, tokenizer, cfg, version_of, group_id, s, env, replay)
                for s in seeds]
        return [f.result() for f in futs]
