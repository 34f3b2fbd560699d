"""A throwaway environment for tests/integration/test_envs_registry.py: registered at run time, never in the table.

``echo``: the task names a word; the ``peek`` tool returns it; the answer is the word.  Its
settings are the ``env:`` section (``kind`` alone when registered at run time; a third-party
package's variant adds ``seed``), read for nothing but the seed (0 without one), so the test sees
the plugin's section reach its task source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neon_hpc.envs.base import EnvPlugin

WORDS = ("alpha", "beta", "gamma", "delta")


@dataclass(frozen=True)
class EchoTask:
    id: str
    word: str


@dataclass(frozen=True)
class EchoTasks:
    settings: Any
    label: str = "echo"

    @property
    def seed(self) -> int:
        return getattr(self.settings, "seed", 0)

    def describe(self) -> str:
        return "echo/train"

    def _draw(self, split: str, n: int, seed: int) -> list[EchoTask]:
        return [EchoTask(f"echo-{split}-{seed}-{i}", WORDS[(seed + i) % len(WORDS)]) for i in range(n)]

    def train(self, n: int | None = None) -> list:
        return self._draw("train", 4 if n is None else min(4, n), self.seed)

    def demo(self, n: int) -> list:
        return self._draw("train", n, self.seed)

    def held_out(self, split: str, n: int, seed: int) -> list:
        return self._draw(split, n, seed)


class EchoEnv:
    def __init__(self, task: EchoTask, tool_chars: int):
        self.task, self.task_id, self.tool_chars = task, task.id, tool_chars
        self.peeks = 0

    def system_text(self) -> str:
        return "echo"

    def task_text(self) -> str:
        return "peek then answer"

    def run_tool(self, call: Any) -> dict:
        if call.name != "peek":
            return {"error": f"unknown tool {call.name!r}; tools: peek"}
        self.peeks += 1
        return {"word": self.task.word}

    def format_result(self, result: dict) -> str:
        return " ".join(f"{k} {v}" for k, v in result.items())[: self.tool_chars]

    def parse_answer(self, text: str | None) -> str | None:
        return text.strip() if text else None

    def grade(self, predicted: str | None) -> tuple[float, float, dict]:
        ok = predicted == self.task.word
        return float(ok), float(ok), {"truth": self.task.word, "peeks": self.peeks}


PLUGIN = EnvPlugin(name="echo", about="throwaway test environment: peek, then echo the word",
                   tasks=EchoTasks,
                   environment=lambda task, _settings, rollout_cfg: EchoEnv(task, rollout_cfg.max_tool_chars))
EVAL_SPLITS = ("test_id", "test_ood")      # what it registers with (envs.register(PLUGIN, EVAL_SPLITS))
