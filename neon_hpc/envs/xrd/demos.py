"""Demonstration conversations for SFT / mid-training: the baseline solver's actions, in the agent's tokens.

``neon-hpc demos --out DIR [--config CONFIG] [--n N] [--imperfect F]`` (``neon_hpc/launch/demos_cli.py``) writes
HDF5 shards of the trajectory schema (``neon_hpc.store``) for **train-split tasks only** (``env.preset``,
``split=train``, ``env.seed``): one conversation per task, rendered by the agent loop's
:func:`~neon_hpc.rollout.agent.demos.render_demo` with the same chat template
(:mod:`~neon_hpc.rollout.agent.template`), tools and prompt style (``env.tools``,
``env.prompt_style``), tool texts (:class:`~neon_hpc.envs.xrd.env.XRDEnv`:
the tools really run, their results clipped as in an episode) and answer format the agent
loop uses, so a demonstration is token for token what :class:`~neon_hpc.rollout.agent.episode.Episode`
records when the model emits the same actions (``tests/unit/envs/test_demos.py``). ``loss_mask`` is 1 on
the assistant's tokens only; ``rewards`` are the grader's.

The actions (compact style, the tiny model's): turn 1 ``<tool_call>search_phases ELEMENTS</tool_call>``
(the solver's candidate search), turn 2 ``<tool_call>fit_phases ID ...</tool_call>`` (the solver's
phases, as many ids as fit ``rollout.max_new_tokens``), then the answer: the strongest-peak
positions of the solver's phases (``<answer>43 27``, one position per phase, closed by ``</answer>`` when it fits
the forced turn's cap; the compact answer gives named phases equal fractions). The forced final turn is used
when the rollout forces one (``rollout.force_answer``), with ``rollout.answer_max_new_tokens`` as its cap, as the
agent does.

Imperfect demonstrations (a share ``--imperfect`` of the tasks, chosen by a seeded draw) leave RL
room above SFT: ``wrong_minor`` replaces the minor phase by a distractor candidate (one-phase
tasks: adds a distractor), ``rough_fraction`` names the major phase alone (its fraction rounded
to 1; one-phase tasks: adds a distractor). ``metadata["demo"]`` records the kind.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from neon_hpc.envs.xrd.env import XRDEnv
from neon_hpc.envs.xrd.science import baseline
from neon_hpc.rollout.agent.demos import Demo, render_demo, write_demo_shards
from neon_hpc.rollout.agent.template import TAGS

KINDS = ("solver", "wrong_minor", "rough_fraction")


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


def demo_kinds(n: int, imperfect: float, seed: int) -> list[str]:
    """Which tasks get an imperfect demonstration: exactly ``round(imperfect * n)`` of them, seeded."""
    rng = random.Random(f"demos-{seed}")
    k = int(round(imperfect * n))
    picks = set(rng.sample(range(n), k))
    return [rng.choice(KINDS[1:]) if i in picks else "solver" for i in range(n)]


def make_demos(tasks: list, tokenizer: Any, settings: Any, cfg: Any, imperfect: float = 0.0, seed: int = 0) -> list:
    """One demonstration per task (train split only: a test task is refused); ``settings`` is the
    ``env:`` section (kind xrd: tools, prompt style), ``cfg`` the rollout section."""
    held = [t.id for t in tasks if t.split != "train"]
    if held:
        raise ValueError(f"demonstrations are for train-split tasks only; got {held[0]} (split of a test set)")
    kinds = demo_kinds(len(tasks), imperfect, seed)
    out = []
    for i, (task, kind) in enumerate(zip(tasks, kinds)):
        env = XRDEnv.configured(task, settings, cfg)
        sol = baseline.solve(env.ctx).phases
        demo = plan_demo(env, cfg, kind, random.Random(f"{seed}-{i}"), sol)
        out.append(render_demo(env, tokenizer, cfg, demo))
    return out


def write_demos(out_dir: str | Path, tasks: list, tokenizer: Any, settings: Any, cfg: Any, imperfect: float,
                seed: int, per_shard: int = 64) -> dict:
    """Demonstrations as shards ``demos-NNNN.h5`` in ``out_dir`` (each published by rename); a summary."""
    return write_demo_shards(out_dir, make_demos(tasks, tokenizer, settings, cfg, imperfect, seed), per_shard)
