"""Demonstrations (``neon_hpc/envs/xrd/demos.py``): the agent loop's tokens for the solver's actions.

Each demonstration is replayed through the real agent loop (:class:`Episode`) with a client that
emits exactly the demonstration's assistant tokens: the books (tokens, loss mask, turn offsets,
rewards) must be identical. The solver's demonstrations of tasks whose truth the compact answer
can state (one phase, or two at near-equal fractions) grade success 1; the imperfect ones 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from neon_hpc import config
from neon_hpc.envs.xrd.demos import demo_kinds, make_demos, write_demos
from neon_hpc.envs.xrd.env import XRDEnv
from neon_hpc.envs.xrd.science.grader import TOL
from neon_hpc.envs.xrd.science.tasks import load_tasks
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.rollout.agent.episode import Episode
from repo_paths import REPO

TOK = load_tokenizer("xrd-tiny")
CFG = config.load(str(REPO / "configs" / "tiny_cpu.yaml"))


class _Result:
    def __init__(self, ids, version):
        self.output_ids, self.output_logprobs, self.weight_version = ids, [0.0] * len(ids), version
        self.routed_experts, self.prompt_tokens = None, 0


class TokenScript:
    """An engine that answers turn k with the k-th list of token ids (cut to max_new_tokens, as an engine)."""

    def __init__(self, turns):
        self.turns, self.requests = [list(t) for t in turns], []

    def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False,
                 routed_experts_start_len=None):
        self.requests.append(list(input_ids))
        return _Result(self.turns.pop(0)[:sampling_params["max_new_tokens"]], "0")


def _generated_turns(t):
    offs = list(t.turn_offsets)
    return [[int(x) for x, m in zip(t.tokens[a:b], t.loss_mask[a:b]) if m] for a, b in zip(offs[:-1], offs[1:])]


def _expressible(truth) -> bool:
    """The compact answer names phases with equal fractions: one phase, or two within TOL of 1/2."""
    return len(truth) == 1 or all(abs(w - 1 / len(truth)) <= TOL for _id, _f, w in truth)


@pytest.fixture(scope="module")
def demos():
    tasks = load_tasks("tiny", "train", 0, 10)
    return tasks, make_demos(tasks, TOK, CFG.env, CFG.rollout, imperfect=0.4, seed=0)


def test_demos_are_what_the_agent_loop_records_for_the_same_actions(demos):
    tasks, trajs = demos
    for task, demo in zip(tasks, trajs):
        env = XRDEnv.configured(task, CFG.env, CFG.rollout)
        # routes are not what is compared (demonstrations carry none): the engine stub sends none
        ep = Episode(TokenScript(_generated_turns(demo)), env, TOK, CFG.rollout, replay="off").run()
        t = ep.trajectory(reward_key=CFG.rollout.reward)
        assert np.array_equal(t.tokens, demo.tokens), task.id
        assert np.array_equal(t.loss_mask, demo.loss_mask) and np.array_equal(t.turn_offsets, demo.turn_offsets)
        assert t.rewards == demo.rewards and t.metadata["answer"] == demo.metadata["answer"]
        assert t.metadata["finish"] == demo.metadata["finish"] == "answer"
        # the assistant's tokens only: two tool calls and the answer, each within the rollout's caps
        gen = _generated_turns(demo)
        assert len(gen) == CFG.rollout.max_turns and max(len(g) for g in gen) <= CFG.rollout.max_new_tokens
        assert len(gen[-1]) <= CFG.rollout.answer_max_new_tokens
        assert TOK.decode(gen[0]).startswith("<tool_call>search_phases ")
        assert TOK.decode(gen[1]).startswith("<tool_call>fit_phases ")
        assert demo.metadata["tool_errors"] == 0
        # an answer that fits the forced turn's cap ends as the model must end it: with the stop tag
        answer_ids = list(TOK.encode(demo.metadata["answer"] + "</answer>"))
        if len(answer_ids) <= CFG.rollout.answer_max_new_tokens:
            assert gen[-1] == answer_ids and gen[-1][-1] in ep.template.stop_token_ids()


def test_the_grader_scores_the_correct_demonstrations_1(demos):
    tasks, trajs = demos
    kinds = [t.metadata["demo"] for t in trajs]
    assert kinds == demo_kinds(len(tasks), 0.4, 0) and kinds.count("solver") == 6
    scored = 0
    for task, t in zip(tasks, trajs):
        if t.metadata["demo"] == "solver" and _expressible(task.truth):
            assert t.rewards["success"] == 1.0, (task.id, task.truth, t.metadata["answer"])
            scored += 1
        elif t.metadata["demo"] != "solver":
            assert t.rewards["success"] == 0.0, (task.id, t.metadata["demo"], t.metadata["answer"])
    assert scored >= 3


def test_demonstrations_refuse_test_tasks_and_write_shards(tmp_path):
    from neon_hpc.store import read_shard
    with pytest.raises(ValueError, match="train-split tasks only"):
        make_demos(load_tasks("tiny", "test_id", 0, 1), TOK, CFG.env, CFG.rollout)
    s = write_demos(tmp_path, load_tasks("tiny", "train", 0, 2), TOK, CFG.env, CFG.rollout, imperfect=0.0, seed=0)
    back = read_shard(tmp_path / "demos-0000.h5")
    assert s["demos"] == 2 == len(back) and all(t.metadata["demo"] == "solver" for t in back)
    assert s["assistant_tokens"] == sum(int(t.loss_mask.sum()) for t in back) > 0


def test_a_compact_answer_names_only_listed_positions(demos):
    """A number names the candidate listed at that position; any other number makes the answer name nothing."""
    tasks, _ = demos
    for task in tasks:
        env = XRDEnv.configured(task, CFG.env, CFG.rollout)
        listed = {int(round(tt)): pid for pid, _f, tt in reversed(env.candidates())}
        right = sorted({listed[int(round(tt))] for pid, _f, tt in env.candidates()
                        if pid in {t[0] for t in task.truth}})
        for pos, pid in listed.items():
            assert env.parse_answer(str(pos)) == [(pid, 1.0)]
        unlisted = next(x for x in range(20, 71) if x not in listed)
        assert env.grade(env.parse_answer(str(unlisted)))[:2] == (0.0, 0.0)
        assert env.grade(env.parse_answer(f"{next(iter(listed))} {unlisted}"))[:2] == (0.0, 0.0)
        assert right, task.id
