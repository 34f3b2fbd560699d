"""The XRD environment (powder X-ray diffraction) as a plugin: the task source over
``neon_hpc.envs.xrd.science`` (presets, splits), the episode adapter (:mod:`.env`: prompts, tools, answer
reading, grading), its answer parser (:mod:`.answer`), the solver's demonstrations
(:mod:`.demos`) and the LLM agent evaluation (:mod:`.eval_cli`, ``neon-hpc xrd eval --endpoint``,
with its report :mod:`.report`).
Its settings are the ``env:`` section of ``kind: xrd`` (``neon_hpc/envs/xrd/config.py``): the task set (preset, split,
number, seed), the toolset (``env.tools``) and the prompt style (``env.prompt_style``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neon_hpc.envs.base import EnvPlugin
from neon_hpc.envs.xrd import demos
from neon_hpc.envs.xrd.entry import ENTRY
from neon_hpc.envs.xrd.env import XRDEnv
from neon_hpc.envs.xrd.science.tasks import load_tasks


@dataclass(frozen=True)
class XRDTasks:
    """Tasks of ``env.preset``: RL samples ``env.num_tasks`` of ``env.split`` (seed ``env.seed``)."""

    settings: Any      # XRDConfig

    @property
    def seed(self) -> int:
        return self.settings.seed

    @property
    def label(self) -> str:
        return self.settings.preset

    def describe(self) -> str:
        return f"{self.settings.preset}/{self.settings.split}"

    def train(self, n: int | None = None) -> list:
        s = self.settings
        return load_tasks(s.preset, s.split, seed=s.seed, n=s.num_tasks if n is None else min(s.num_tasks, n))

    def demo(self, n: int) -> list:
        return load_tasks(self.settings.preset, "train", seed=self.settings.seed, n=n)

    def held_out(self, split: str, n: int, seed: int) -> list:
        return load_tasks(self.settings.preset, split, seed=seed, n=n)


def write_demos(*args, **kwargs) -> dict:
    return demos.write_demos(*args, **kwargs)


PLUGIN = EnvPlugin(name="xrd", about="powder X-ray diffraction", tasks=XRDTasks, environment=XRDEnv.configured,
                   write_demos=write_demos, cli=ENTRY.cli)
