"""One episode, token by token: model output -> tool calls -> results -> next turn -> answer.

The environment (what the task says, which tools exist, how an answer is graded) is an
:class:`~neon_hpc.envs.base.Environment` of a registered plugin (``neon_hpc/envs/``; XRD's is
:class:`neon_hpc.envs.xrd.env.XRDEnv`).  This module only keeps the books a trainer needs:

- ``tokens``: the whole conversation, exactly the concatenation of every turn's prompt
  additions and model outputs (never re-tokenized);
- ``loss_mask`` 1 on tokens the model generated, 0 on everything the environment appended;
- ``logprobs`` / ``versions``: the engine's logprob and the weight version of each generated
  token (0 / -1 elsewhere); versions come from the response's ``weight_versions`` spans when
  the engine sent them (weights updated in place mid-response), else its ``weight_version``;
- ``routed_experts``: assembled by delta router replay, one row per token;
- ``turn_offsets``: turn ``k`` is ``[turn_offsets[k], turn_offsets[k+1])``: the tokens the
  environment appended before generation ``k``, then that generation.

Tool errors and malformed calls are fed back to the model as tool messages and counted;
nothing the model writes can crash the episode.  An episode ends on an answer, the turn
limit, the token budget, or the wall-clock limit (``finish`` in the metadata says which).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from neon_hpc.config.offpolicy import OffpolicyConfig
from neon_hpc.envs.base import Environment
from neon_hpc.replay import ReplayConversation
from neon_hpc.rollout.agent.parse import Answer, Malformed, ToolCall, parse_action
from neon_hpc.rollout.agent.template import ChatTemplate, make_template


@dataclass
class Ledger:
    """Per-token books of one conversation."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_offsets: list[int] = field(default_factory=lambda: [0])

    def add_env(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_generated(self, ids: list[int], logprobs: list[float], version: int | list[int]) -> None:
        """``version``: one for every token, or one per token (a weight update inside the response)."""
        if len(logprobs) != len(ids):
            raise ValueError(f"engine returned {len(logprobs)} logprobs for {len(ids)} output tokens; "
                             f"request return_logprob=true")
        versions = [int(version)] * len(ids) if isinstance(version, int) else [int(v) for v in version]
        if len(versions) != len(ids):
            raise ValueError(f"engine reported versions for {len(versions)} of {len(ids)} output tokens")
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += versions

    def end_turn(self) -> None:
        self.turn_offsets.append(len(self.tokens))


REPLAY_DEFAULT = OffpolicyConfig.replay_engine   # offpolicy.replay_engine: the routes the engine exports


class EpisodeStopped(Exception):
    """The worker is stopping: the episode ended at a turn boundary (its journal record is current)."""


@dataclass
class Counters:
    tool_calls: int = 0
    tool_errors: int = 0
    malformed: int = 0
    no_action: int = 0


def sampling_params(cfg, template: ChatTemplate, max_new_tokens: int, seed: int | None) -> dict:
    sp = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": max_new_tokens,
          "stop_token_ids": template.stop_token_ids()}
    if seed is not None:
        sp["sampling_seed"] = seed
    return sp


class Episode:
    """Runs one conversation; :meth:`run` returns the finished books and outcome."""

    def __init__(self, client: Any, env: Environment, tokenizer: Any, cfg: Any,
                 version_of: Callable[[str], int] = int, seed: int | None = None,
                 replay: str = REPLAY_DEFAULT):
        self.env, self.tok, self.cfg, self.seed = env, tokenizer, cfg, seed
        self.template = make_template(tokenizer)
        # replay: which routes the engine exports (offpolicy.replay_engine: delta, full, off)
        self.conv = ReplayConversation(client, mode=replay, version_of=version_of,
                                       max_retries=getattr(cfg, "request_retries", 2))
        self.version_of = version_of
        self.ledger, self.counts = Ledger(), Counters()
        self.finish, self.answer_text, self.texts = "max_turns", None, []
        self.timings = {"generate_s": 0.0, "tool_s": 0.0}
        # where the episode stands (the journal saves and restores these: neon_hpc/rollout/journal.py)
        self.started, self.turn, self.done, self.resumes = False, 0, False, 0
        self.on_boundary: Callable[["Episode"], None] | None = None   # called at every turn boundary
        self.stop_event: Any = None     # a threading.Event: set, the episode stops at the next boundary

    def run(self) -> "Episode":
        """Run the episode to its end, from where it stands (a journalled one resumes its turn)."""
        t0 = time.monotonic() - self.timings.get("elapsed_s", 0.0)
        if not self.started:
            self.ledger.add_env(self.template.opening(self.env.system_text(), self.env.task_text()))
            self.started = True
        while not self.done and self.turn < self.cfg.max_turns:
            self._boundary(t0)
            stop = self._limit_reached(t0)
            if stop:
                self.finish = stop
                break
            last = self.turn == self.cfg.max_turns - 1
            forced = last and getattr(self.cfg, "force_answer", True)
            if forced:
                self.ledger.add_env(self.template.force_answer())
            text = self._generate(getattr(self.cfg, "answer_max_new_tokens", 0) if forced else 0)
            if text is None:
                break
            ended = self._act(text, forced=forced)
            self.turn += 1
            if ended:
                break
        self.done = True
        self.timings["episode_s"] = self.timings["elapsed_s"] = time.monotonic() - t0
        if self.on_boundary is not None:
            self.on_boundary(self)
        return self

    def _boundary(self, t0: float) -> None:
        """A turn boundary: the books are whole; save them, then stop here if asked to."""
        self.timings["elapsed_s"] = time.monotonic() - t0
        if self.on_boundary is not None:
            self.on_boundary(self)
        if self.stop_event is not None and self.stop_event.is_set():
            raise EpisodeStopped(self.env.task_id)

    def _limit_reached(self, t0: float) -> str | None:
        if time.monotonic() - t0 > self.cfg.episode_timeout_s:
            return "timeout"
        if self.cfg.max_total_tokens - len(self.ledger.tokens) <= 0:
            return "token_budget"
        return None

    def _generate(self, cap: int = 0) -> str | None:
        budget = min(cap or self.cfg.max_new_tokens, self.cfg.max_total_tokens - len(self.ledger.tokens))
        if budget <= 0:
            self.finish = "token_budget"
            return None
        t = time.monotonic()
        res = self.conv.generate(self.ledger.tokens, sampling_params(self.cfg, self.template, budget, self.seed))
        self.timings["generate_s"] += time.monotonic() - t
        if self.seed is not None:
            self.seed += 1
        out = [int(i) for i in res.output_ids]
        versions = (res.token_versions(self.version_of) if hasattr(res, "token_versions")
                    else self.version_of(res.weight_version))   # per token when the engine sent spans
        self.ledger.add_generated(out, list(res.output_logprobs or []), versions)
        text = self.tok.decode(out)
        self.texts.append(text)
        return text

    def _act(self, text: str, forced: bool) -> bool:
        """Handle one output; True when the episode is over."""
        action = parse_action(self.template.tags.answer + text if forced else text)
        if isinstance(action, Answer):
            self.answer_text, self.finish = action.text, "answer"
            self.ledger.end_turn()
            return True
        if forced:   # cannot happen (forced text always parses as an answer); kept for clarity
            self.ledger.end_turn()
            return True
        content = self._respond(action)
        self.ledger.end_turn()
        if len(self.ledger.tokens) >= self.cfg.max_total_tokens:
            self.finish = "token_budget"
            return True
        last = self.ledger.tokens[-1] if self.ledger.loss_mask and self.ledger.loss_mask[-1] else None
        self.ledger.add_env(self.template.after_output("tool", content, last_token=last))
        return False

    def _respond(self, action) -> str:
        if isinstance(action, ToolCall):
            self.counts.tool_calls += 1
            t = time.monotonic()
            result = self.env.run_tool(action)
            self.timings["tool_s"] += time.monotonic() - t
            if isinstance(result, dict) and "error" in result:
                self.counts.tool_errors += 1
            return self.env.format_result(result)
        if isinstance(action, Malformed):
            self.counts.malformed += 1
            return self.env.format_result({"error": f"malformed tool call: {action.reason}"})
        self.counts.no_action += 1
        return self.env.format_result({"error": "no tool call and no answer; call a tool or answer "
                                                "with <answer>...</answer>"})

    # --- results -----------------------------------------------------------------------
    def trajectory(self, group_id: str = "", reward_key: str = "dense"):
        from neon_hpc.store import Trajectory  # deferred: heavy (neon_hpc.store: h5py, pydantic)

        predicted = self.env.parse_answer(self.answer_text) if self.answer_text is not None else None
        success, dense, details = self.env.grade(predicted)
        led = self.ledger
        # Tokens appended after the last generation (a tool result the model never read)
        # carry nothing to train on; drop them so every turn ends with a generation.
        n = led.turn_offsets[-1] if len(led.turn_offsets) > 1 else len(led.tokens)
        if len(led.turn_offsets) == 1:
            led.end_turn()
        del led.tokens[n:], led.loss_mask[n:], led.logprobs[n:], led.versions[n:]
        rewards = {"success": float(success), "dense": float(dense)}
        meta = {"finish": self.finish, "turns": len(led.turn_offsets) - 1,
                "answer": self.answer_text, "predicted": _jsonable(predicted),
                "tool_calls": self.counts.tool_calls, "tool_errors": self.counts.tool_errors,
                "malformed_calls": self.counts.malformed, "no_action_turns": self.counts.no_action,
                "grade": _jsonable(details), "replay_mode": self.conv.mode,
                "replay": self.conv.stats.as_dict(), "replay_retries": self.conv.retries}
        if self.conv.mode != "off" and self.conv.cache.routed_experts is not None:
            meta["route_versions"] = self.conv.cache.version_runs()
        return Trajectory(
            tokens=np.asarray(led.tokens, np.int32), loss_mask=np.asarray(led.loss_mask, np.uint8),
            logprobs=np.asarray(led.logprobs, np.float32), versions=np.asarray(led.versions, np.int32),
            routed_experts=self.conv.routed_experts(n), reward=rewards[reward_key], rewards=rewards,
            task_id=self.env.task_id, group_id=group_id,
            turn_offsets=np.asarray(led.turn_offsets, np.int64), metadata=meta,
            timings=dict(self.timings))


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        if hasattr(x, "__dict__"):
            return _jsonable(vars(x))
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        return repr(x)
