"""A small environment that proves the plugin seam: add two digits, no tools.

The prompt is one line, ``add 3 4``; the answer ``<answer>7</answer>`` (a sum of two digits is
one token of the ``xrd-tiny`` vocabulary: ``0``-``9`` are characters, ``10``-``18`` numbers), so
it fits ``configs/tiny_cpu.yaml``'s forced answer of ``rollout.answer_max_new_tokens: 3``.
Success is the exact sum; the dense reward ``1 - |answer - sum| / 18`` (0 for an unreadable
answer) gives a group of episodes a gradient before any is exact.  A tool call gets an error
back (there are none).

Tasks: the 100 ordered pairs of digits, split for good: a pair whose ``(10a + b) % 4 == 0`` is
held out (25 pairs, the eval set's), the other 75 are train (RL and nothing else); a list of
``n`` is a seeded shuffle of its pool, cycled when ``n`` is larger (one held-out split,
``test_id``: its registry line).  No settings (``env.kind: digits`` alone).

Demonstrations (the main job's warm start): the answer in the first turn, ``<answer>7</answer>``;
a share ``warm_start.imperfect`` of them (a seeded draw of exactly that many) states a wrong sum
(``metadata["demo"]``: ``solver`` or ``wrong_sum``), so RL has room above SFT.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from neon_hpc.envs.base import EnvPlugin
from neon_hpc.rollout.agent.demos import Demo, render_demo, write_demo_shards
from neon_hpc.rollout.agent.template import TAGS

MAX_SUM = 18


@dataclass(frozen=True)
class DigitsTask:
    id: str
    a: int
    b: int
    split: str


def _pool(held_out: bool) -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10) if ((10 * a + b) % 4 == 0) == held_out]


def _draw(split: str, n: int, seed: int) -> list[DigitsTask]:
    pool = _pool(held_out=split != "train")
    random.Random(f"digits-{split}-{seed}").shuffle(pool)
    return [DigitsTask(f"digits-{split}-{seed}-{i}-{a}+{b}", a, b, split)
            for i, (a, b) in enumerate(pool[i % len(pool)] for i in range(n))]


@dataclass(frozen=True)
class DigitsTasks:
    """The task source: no settings; RL samples 64 train tasks (seed 0)."""

    settings: Any = None
    seed: int = 0
    label: str = "digits"
    num_train: int = 64

    def describe(self) -> str:
        return "digits/train"

    def train(self, n: int | None = None) -> list:
        return _draw("train", self.num_train if n is None else min(self.num_train, n), self.seed)

    def demo(self, n: int) -> list:
        return _draw("train", n, self.seed)

    def held_out(self, split: str, n: int, seed: int) -> list:
        if split == "train":
            raise ValueError("the eval set is held out: choose a test split, not 'train'")
        return _draw(split, n, seed)


class DigitsEnv:
    """One ``add a b`` task for one episode."""

    def __init__(self, task: DigitsTask):
        self.task, self.task_id = task, task.id

    def system_text(self) -> str:
        return "digits"

    def task_text(self) -> str:
        return f"add {self.task.a} {self.task.b}"

    def run_tool(self, call: Any) -> dict:
        return {"error": "no tools here; answer with <answer>SUM</answer>"}

    def snapshot(self) -> dict:
        """The episode's state (the journal's): the task alone; no tool keeps any."""
        return {"task_id": self.task_id}

    def restore(self, state: dict) -> None:
        if state.get("task_id") != self.task_id:
            raise ValueError(f"snapshot of {state.get('task_id')!r} restored into digits task {self.task_id!r}")

    def format_result(self, result: dict) -> str:
        return str(result.get("error", result))[:96]

    def parse_answer(self, text: str | None) -> int | None:
        m = re.search(r"\d+", text or "")
        return int(m.group(0)) if m else None

    def grade(self, predicted: int | None) -> tuple[float, float, dict]:
        truth = self.task.a + self.task.b
        if predicted is None:
            return 0.0, 0.0, {"truth": truth, "predicted": None}
        dense = max(0.0, 1.0 - abs(predicted - truth) / MAX_SUM)
        return float(predicted == truth), dense, {"truth": truth, "predicted": predicted}


def make_demos(tasks: list, tokenizer: Any, rollout_cfg: Any, imperfect: float, seed: int) -> list:
    """One demonstration per train task: the right sum, or (``imperfect`` of them) a wrong one."""
    held = [t.id for t in tasks if t.split != "train"]
    if held:
        raise ValueError(f"demonstrations are for train tasks only; got {held[0]}")
    rng = random.Random(f"digits-demos-{seed}")
    wrong = set(rng.sample(range(len(tasks)), int(round(imperfect * len(tasks)))))
    out = []
    for i, task in enumerate(tasks):
        total = task.a + task.b
        answer = (total + 1 + rng.randrange(MAX_SUM)) % (MAX_SUM + 1) if i in wrong else total
        demo = Demo([f"{TAGS.answer}{answer}{TAGS.answer_end}"], "wrong_sum" if i in wrong else "solver", forced=False)
        out.append(render_demo(DigitsEnv(task), tokenizer, rollout_cfg, demo))
    return out


def write_demos(out_dir: Any, tasks: list, tokenizer: Any, _settings: None, rollout_cfg: Any, imperfect: float,
                seed: int) -> dict:
    return write_demo_shards(out_dir, make_demos(tasks, tokenizer, rollout_cfg, imperfect, seed))


PLUGIN = EnvPlugin(name="digits", about="add two digits, no tools",
                   tasks=lambda _settings: DigitsTasks(), environment=lambda task, _settings, _cfg: DigitsEnv(task),
                   write_demos=write_demos)
