"""The agent loop: multi-turn tool use against any SGLang-compatible endpoint.

``run_episode`` / ``run_group`` produce ``neon_hpc.store.Trajectory`` objects with exact
token-level books (see ``episode.py``); the environment of a task comes from its plugin bound to
the plugin's config section (``neon_hpc/envs/``: ``run_group(..., env=neon_hpc.envs.configured(cfg))``).
"""
from neon_hpc.rollout.agent.episode import Environment, Episode
from neon_hpc.rollout.agent.group import as_environment, run_episode, run_group
from neon_hpc.rollout.agent.parse import Answer, Malformed, Nothing, ToolCall, parse_action

__all__ = ["Environment", "Episode", "as_environment", "run_episode", "run_group", "Answer",
           "Malformed", "Nothing", "ToolCall", "parse_action"]
