"""Demonstration conversations for SFT / mid-training: the baseline solver's actions, in the agent's tokens.

``neon-hpc demos --out DIR [--config CONFIG] [--n N] [--imperfect F]`` (``neon_hpc/launch/demos_cli.py``) writes HDF5 shards of the
trajectory schema (``neon_hpc.store``) for **train-split tasks only** (``xrd.preset``,
``split=train``, ``xrd.seed``): one conversation per task, rendered with the same chat template
(:mod:`~neon_hpc.rollout.agent.template`), tool texts (:class:`~neon_hpc.envs.xrd.env.XRDEnv`:
the tools really run, their results clipped as in an episode) and answer format the agent
loop uses, so a demonstration is token for token what :class:`~neon_hpc.rollout.agent.episode.Episode`
records when the model emits the same actions (``tests/test_demos.py``). ``loss_mask`` is 1 on
the assistant's tokens only; ``rewards`` are the grader's.

The actions (compact style, the tiny model's): turn 1 ``<tool_call>search_phases ELEMENTS</tool_call>``
(the solver's candidate search), turn 2 ``<tool_call>fit_phases ID ...</tool_call>`` (the solver's
phases, as many ids as fit ``rollout.max_new_tokens``), then the answer: the strongest-peak
positions of the solver's phases (``<answer>43 27``, one position per phase, closed by ``</answer>`` when it fits the forced turn's cap; the compact answer
gives named phases equal fractions). The forced final turn is used when the rollout forces one
(``rollout.force_answer``), with ``rollout.answer_max_new_tokens`` as its cap, as the agent does.

Imperfect demonstrations (a share ``--imperfect`` of the tasks, chosen by a seeded draw) leave RL
room above SFT: ``wrong_minor`` replaces the minor phase by a distractor candidate (one-phase
tasks: adds a distractor), ``rough_fraction`` names the major phase alone (its fraction rounded
to 1; one-phase tasks: adds a distractor). ``metadata["demo"]`` records the kind.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neon_hpc.rollout.agent.episode import Ledger
from neon_hpc.rollout.agent.parse import Answer, ToolCall, parse_action
from neon_hpc.rollout.agent.template import TAGS, make_template
from neon_hpc.envs.xrd.env import XRDEnv

KINDS = ("solver", "wrong_minor", "rough_fraction")
DEMO_VERSION = 0          # generated tokens carry a version like an engine's (the trainer's SFT ignores it)


@dataclass
class Demo:
    """The texts the model 'writes' in each turn (tool calls, then the answer) and their kind."""

    turns: list[str]
    kind: str
    forced: bool            # the last text follows an environment-appended <answer>


def _positions(env: XRDEnv, ids: list[str]) -> list[int]:
    pos = {pid: int(round(tt)) for pid, _f, tt in env.candidates()}
    return [pos[p] for p in ids if p in pos]


def plan_demo(env: XRDEnv, cfg: Any, kind: str, rng: random.Random, solution: list[tuple[str, float]]) -> Demo:
    """The actions of one demonstration: the solver's (``kind='solver'``) or an imperfect variant."""
    phases = [p for p, _w in sorted(solution, key=lambda x: -x[1])]
    taken = set(_positions(env, phases))
    distractors = [pid for pid, _f, tt in env.candidates() if pid not in phases and int(round(tt)) not in taken]
    answer_ids = list(phases)
    if kind != "solver" and distractors:
        d = rng.choice(distractors)
        if len(answer_ids) >= 2 and kind == "wrong_minor":
            answer_ids = answer_ids[:-1] + [d]
        elif len(answer_ids) >= 2:            # rough_fraction: the major phase alone
            answer_ids = answer_ids[:1]
        else:
            answer_ids = answer_ids + [d]
    calls = [f"<tool_call>search_phases {' '.join(env.task.elements)}</tool_call>",
             "<tool_call>fit_phases " + " ".join(phases) + "</tool_call>"]
    n_calls = max(0, min(len(calls), cfg.max_turns - 1))
    turns = calls[:n_calls]
    answer = " ".join(str(p) for p in _positions(env, answer_ids))
    forced = bool(getattr(cfg, "force_answer", True)) and n_calls == cfg.max_turns - 1
    # a forced answer ends as the model must end it, with the answer's closing tag (a stop token):
    # without it a one-phase demonstration teaches nothing about stopping, and the model then
    # fills the forced turn's token cap with a second, wrong position
    return Demo(turns + [f"{answer}{TAGS.answer_end}" if forced else f"{TAGS.answer}{answer}{TAGS.answer_end}"],
                kind, forced)


def fit_turn(text: str, tokenizer: Any, cap: int) -> list[int]:
    """A tool call's ids within ``cap`` tokens: ids dropped from the end of the argument list."""
    ids = list(tokenizer.encode(text))
    while len(ids) > cap and text.startswith("<tool_call>") and len(text.split()) > 2:
        head, _drop = text[:-len("</tool_call>")].rsplit(" ", 1)
        text = head + "</tool_call>"
        ids = list(tokenizer.encode(text))
    return ids[:cap]


def render_demo(env: XRDEnv, tokenizer: Any, cfg: Any, demo: Demo):
    """The demonstration as a :class:`~neon_hpc.store.Trajectory`: the agent loop's books for these actions."""
    from neon_hpc.store import Trajectory
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
            "answer": answer_text, "predicted": [list(p) for p in predicted or []], "tool_calls": tool_calls,
            "tool_errors": tool_errors, "demo": demo.kind, "grade": json.loads(json.dumps(details, default=str))}
    return Trajectory(tokens=np.asarray(led.tokens, np.int32), loss_mask=np.asarray(led.mask, np.uint8),
                      logprobs=np.asarray(led.logprobs, np.float32), versions=np.asarray(led.versions, np.int32),
                      routed_experts=None, reward=rewards[getattr(cfg, "reward", "dense")], rewards=rewards,
                      task_id=env.task_id, group_id=f"demo-{env.task_id}",
                      turn_offsets=np.asarray(led.turn_offsets, np.int64), metadata=meta)


def demo_kinds(n: int, imperfect: float, seed: int) -> list[str]:
    """Which tasks get an imperfect demonstration: exactly ``round(imperfect * n)`` of them, seeded."""
    rng = random.Random(f"demos-{seed}")
    k = int(round(imperfect * n))
    picks = set(rng.sample(range(n), k))
    return [rng.choice(KINDS[1:]) if i in picks else "solver" for i in range(n)]


def make_demos(tasks: list, tokenizer: Any, cfg: Any, imperfect: float = 0.0, seed: int = 0) -> list:
    """One demonstration per task (train split only: a test task is refused)."""
    from neon_hpc.xrd import baseline
    held = [t.id for t in tasks if t.split != "train"]
    if held:
        raise ValueError(f"demonstrations are for train-split tasks only; got {held[0]} (split of a test set)")
    kinds = demo_kinds(len(tasks), imperfect, seed)
    out = []
    for i, (task, kind) in enumerate(zip(tasks, kinds)):
        env = XRDEnv(task, tools=cfg.tools, style=getattr(cfg, "prompt_style", "auto"),
                     max_tool_chars=getattr(cfg, "max_tool_chars", 2000))
        sol = baseline.solve(env.ctx).phases
        demo = plan_demo(env, cfg, kind, random.Random(f"{seed}-{i}"), sol)
        out.append(render_demo(env, tokenizer, cfg, demo))
    return out


def write_demos(out_dir: str | Path, tasks: list, tokenizer: Any, cfg: Any, imperfect: float, seed: int,
                per_shard: int = 64) -> dict:
    """Demonstrations as shards ``demos-NNNN.h5`` in ``out_dir`` (each published by rename); a summary."""
    from neon_hpc.store import write_shard
    trajs = make_demos(tasks, tokenizer, cfg, imperfect, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for j in range(0, len(trajs), per_shard):
        final = out / f"demos-{j // per_shard:04d}.h5"
        tmp = out / f".{final.name}.tmp"
        write_shard(tmp, trajs[j:j + per_shard], writer_id="demos")
        tmp.replace(final)
    by_kind: dict[str, list[float]] = {}
    for t in trajs:
        by_kind.setdefault(t.metadata["demo"], []).append(t.rewards["success"])
    return {"demos": len(trajs), "dir": str(out),
            "success_by_kind": {k: float(np.mean(v)) for k, v in sorted(by_kind.items())},
            "count_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
            "success": float(np.mean([t.rewards["success"] for t in trajs])) if trajs else None,
            "assistant_tokens": int(sum(int(t.loss_mask.sum()) for t in trajs))}
