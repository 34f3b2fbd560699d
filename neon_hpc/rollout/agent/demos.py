"""Demonstrations in the agent's tokens: an environment's scripted actions rendered as the agent loop records them.

An environment plugin (``neon_hpc/envs/<name>/``) that offers a warm start composes a :class:`Demo`
per task (the texts the model "writes" each turn); :func:`render_demo` plays it against the
environment with the same chat template (:mod:`~neon_hpc.rollout.agent.template`), tool texts
(the tools really run, their results formatted as in an episode) and answer format the agent
loop uses, so a demonstration is token for token what
:class:`~neon_hpc.rollout.agent.episode.Episode` records when the model emits the same actions
(``tests/unit/envs/test_demos.py``); ``loss_mask`` is 1 on the assistant's tokens only, ``rewards`` are the
environment's grade.  :func:`write_demo_shards` publishes them as trajectory shards (the SFT
data of the warm start, ``neon_hpc/launch/warm.py``).  XRD's are ``neon_hpc/envs/xrd/demos.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neon_hpc.envs.base import Environment
from neon_hpc.rollout.agent.episode import Ledger
from neon_hpc.rollout.agent.parse import Answer, ToolCall, parse_action
from neon_hpc.rollout.agent.template import make_template

DEMO_VERSION = 0          # generated tokens carry a version like an engine's (the trainer's SFT ignores it)


@dataclass
class Demo:
    """The texts the model 'writes' in each turn (tool calls, then the answer) and their kind."""

    turns: list[str]
    kind: str
    forced: bool            # the last text follows an environment-appended <answer>



def fit_turn(text: str, tokenizer: Any, cap: int) -> list[int]:
    """A tool call's ids within ``cap`` tokens: ids dropped from the end of the argument list."""
    ids = list(tokenizer.encode(text))
    while len(ids) > cap and text.startswith("<tool_call>") and len(text.split()) > 2:
        head, _drop = text[:-len("</tool_call>")].rsplit(" ", 1)
        text = head + "</tool_call>"
        ids = list(tokenizer.encode(text))
    return ids[:cap]


def render_demo(env: Environment, tokenizer: Any, cfg: Any, demo: Demo):
    """The demonstration as a :class:`~neon_hpc.store.Trajectory`: the agent loop's books for these actions."""
    from neon_hpc.store import Trajectory  # deferred: heavy (neon_hpc.store: h5py, pydantic)
    tpl = make_template(tokenizer)
    led = Ledger()
    led.add_env(tpl.opening(env.system_text(), env.task_text()))
    answer_text, tool_calls, tool_errors = None, 0, 0
    n_turns = len(demo.turns)
    for k, text in enumerate(demo.turns):
        last = k == n_turns - 1
        if last and demo.forced:
            led.add_env(tpl.force_answer())
            ids = list(tokenizer.encode(text))[:cfg.answer_max_new_tokens or cfg.max_new_tokens]
        else:
            ids = fit_turn(text, tokenizer, cfg.max_new_tokens)
        led.add_generated(ids, [0.0] * len(ids), DEMO_VERSION)
        out = tokenizer.decode(ids)
        action = parse_action(tpl.tags.answer + out if (last and demo.forced) else out)
        led.end_turn()
        if isinstance(action, Answer):
            answer_text = action.text
            break
        if not isinstance(action, ToolCall):
            raise ValueError(f"demonstration turn {k} of {env.task_id} is not a tool call: {out!r}")
        result = env.run_tool(action)
        tool_calls += 1
        tool_errors += int(isinstance(result, dict) and "error" in result)
        if not last:
            led.add_env(tpl.after_output("tool", env.format_result(result), last_token=ids[-1]))
    predicted = env.parse_answer(answer_text) if answer_text is not None else None
    success, dense, details = env.grade(predicted)
    rewards = {"success": float(success), "dense": float(dense)}
    meta = {"finish": "answer" if answer_text is not None else "max_turns", "turns": len(led.turn_offsets) - 1,
            "answer": answer_text, "predicted": json.loads(json.dumps(predicted or [], default=str)),
            "tool_calls": tool_calls, "tool_errors": tool_errors, "demo": demo.kind,
            "grade": json.loads(json.dumps(details, default=str))}
    return Trajectory(tokens=np.asarray(led.tokens, np.int32), loss_mask=np.asarray(led.loss_mask, np.uint8),
                      logprobs=np.asarray(led.logprobs, np.float32), versions=np.asarray(led.versions, np.int32),
                      routed_experts=None, reward=rewards[getattr(cfg, "reward", "dense")], rewards=rewards,
                      task_id=env.task_id, group_id=f"demo-{env.task_id}",
                      turn_offsets=np.asarray(led.turn_offsets, np.int64), metadata=meta)



def write_demo_shards(out_dir: str | Path, trajs: list, per_shard: int = 64) -> dict:
    """Demonstrations as the fixed set ``demos`` in ``out_dir`` (the store's ``write_set``: shards
    ``demos-NNNN.h5``, each published by rename); a summary."""
    from neon_hpc.store import store_kind  # deferred: heavy (neon_hpc.store: h5py, pydantic)
    out = Path(out_dir)
    store_kind().write_set(out, trajs, "demos", per_shard)
    by_kind: dict[str, list[float]] = {}
    for t in trajs:
        by_kind.setdefault(t.metadata["demo"], []).append(t.rewards["success"])
    return {"demos": len(trajs), "dir": str(out),
            "success_by_kind": {k: float(np.mean(v)) for k, v in sorted(by_kind.items())},
            "count_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
            "success": float(np.mean([t.rewards["success"] for t in trajs])) if trajs else None,
            "assistant_tokens": int(sum(int(t.loss_mask.sum()) for t in trajs))}
