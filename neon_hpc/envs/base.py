"""The interfaces an environment plugin implements: the environment of one episode, the task
source, and the plugin that ties them to a config section (and may provide demonstrations).

The agent loop (``neon_hpc/rollout/agent/``) runs an :class:`Environment`; the rollout worker,
the eval set and the warm start ask the plugin bound to its config section (:class:`ConfiguredEnv`,
:func:`neon_hpc.envs.configured`) for tasks and for the environment of a task.  This module
imports nothing of neon_hpc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol


class Environment(Protocol):
    """What an episode needs from a task (one instance per episode)."""

    task_id: str

    def system_text(self) -> str: ...
    def task_text(self) -> str: ...
    def run_tool(self, call: Any) -> dict: ...               # a parsed ToolCall; never raises: {"error": ...}
    def parse_answer(self, text: str) -> Any: ...             # None (or empty) when no answer can be read
    def grade(self, predicted: Any) -> tuple[float, float, dict]: ...  # success, dense, details
    def format_result(self, result: dict) -> str: ...


class Snapshotting(Protocol):
    """An environment whose episode state can be saved and restored (the episode journal,
    ``neon_hpc/rollout/journal.py``): ``snapshot()`` returns JSON-able data (no objects, no
    pickle) and ``restore(state)``, called on a fresh environment of the same task, makes it
    equal to the one snapshotted. An environment without them gets its recorded tool calls
    replayed in order on resume instead (its :class:`EnvEntry` says ``resume="replay"``)."""

    def snapshot(self) -> dict: ...
    def restore(self, state: dict) -> None: ...


def can_snapshot(env: Any) -> bool:
    """Whether ``env`` saves its episode state itself (:class:`Snapshotting`)."""
    return callable(getattr(env, "snapshot", None)) and callable(getattr(env, "restore", None))


RESUME_MODES = {"snapshot": "resumes from a snapshot of its state",
                "replay": "resumes by replaying its recorded tool calls"}


class TaskSource(Protocol):
    """The tasks of one environment, as the environment's config section sets them.

    A task is any object with an ``id``; :attr:`EnvPlugin.environment` turns it into an
    :class:`Environment`.  The lists are deterministic functions of the section and arguments.
    """

    seed: int          # seeds the worker's task order
    label: str         # names the task set in eval records, e.g. "tiny" (XRD's preset)

    def describe(self) -> str: ...                                         # the train set in logs: "tiny/train"

    def train(self, n: int | None = None) -> list: ...                     # what RL samples (n: at most)
    def demo(self, n: int) -> list: ...                                    # train tasks to demonstrate
    def held_out(self, split: str, n: int, seed: int) -> list: ...         # the eval set (never train)


@dataclass
class EnvSettings:
    """The base of an environment's ``env:`` section (its variant of the experiment config's
    ``env:`` union, chosen by ``env.kind``): a plugin's settings class subclasses it, declares
    ``kind: Literal["<name>"] = "<name>"`` first, then its own fields, and is marked ``@section``
    (``neon_hpc.util.constraints``).  A plugin without settings has ``kind`` alone."""

    kind: str = ""

    TAG_FIELD = "kind"


@dataclass(frozen=True)
class EnvPlugin:
    """One environment: its task source, its episode environment.

    Every function below gets the experiment config's ``env:`` section as ``settings`` (the
    plugin's variant, :class:`EnvSettings`: ``kind`` and the settings its entry declares).
    ``tasks(settings)`` builds the :class:`TaskSource`; ``environment(task, settings, rollout_cfg)``
    builds one episode's :class:`Environment` (the environment's own settings, e.g. XRD's tools and
    prompt style, come from ``settings``; the rollout section gives the generic limits, e.g. the
    tool text clip ``max_tool_chars``); ``write_demos(out_dir, tasks, tokenizer, settings,
    rollout_cfg, imperfect, seed) -> summary`` writes demonstration shards for the warm start
    (``None``: the environment has none, and the main job skips its warm start); ``cli``: the
    module of ``neon-hpc <name> ...`` ("" = none).  The held-out splits its task source takes
    (``eval.split``) are declared in its :class:`EnvEntry`, so the config is checked without
    importing the environment.
    """

    name: str
    about: str
    tasks: Callable[[Any], TaskSource]
    environment: Callable[[Any, Any, Any], Environment]
    write_demos: Callable[..., dict] | None = None
    cli: str = ""

    def bind(self, settings: Any) -> "ConfiguredEnv":
        """This plugin with its config section (``settings``: the ``env:`` section)."""
        return ConfiguredEnv(self, settings)


@dataclass(frozen=True)
class ConfiguredEnv:
    """An environment plugin with its config section: what the agent loop (``run_group(...,
    env=...)``), the eval set and the warm start build tasks, episodes and demonstrations from."""

    plugin: EnvPlugin
    settings: Any      # the experiment config's env: section (the plugin's variant)

    @property
    def name(self) -> str:
        return self.plugin.name

    def tasks(self) -> TaskSource:
        return self.plugin.tasks(self.settings)

    def environment(self, task: Any, rollout_cfg: Any) -> Environment:
        return self.plugin.environment(task, self.settings, rollout_cfg)

    def write_demos(self, out_dir: Any, tasks: list, tokenizer: Any, rollout_cfg: Any, imperfect: float,
                    seed: int) -> dict:
        if self.plugin.write_demos is None:
            raise ValueError(f"environment {self.name!r} provides no demonstrations")
        return self.plugin.write_demos(out_dir, tasks, tokenizer, self.settings, rollout_cfg, imperfect, seed)


@dataclass(frozen=True)
class EnvEntry:
    """What the registry knows of an environment without importing it: the object an entry point of
    the group ``neon_hpc.envs`` names (``xrd = "neon_hpc.envs.xrd.entry:ENTRY"``).

    Its module imports the settings section and nothing heavy: the config composes ``settings`` as
    the ``env:`` variant of ``kind: <name>`` and checks ``env.kind`` / ``eval.split`` from these fields alone;
    ``plugin`` names the module whose ``PLUGIN`` (:class:`EnvPlugin`) is imported when the
    environment is used; ``cli`` (a module with ``main(argv)``) becomes ``neon-hpc <name> ...``
    with ``cli_help`` as its line in ``neon-hpc --help``.
    """

    name: str
    plugin: str                          # module defining PLUGIN
    about: str                           # one line for `neon-hpc env list`
    eval_splits: tuple[str, ...]         # the held-out splits its task source takes; the first is the usual one
    settings: type | None = None         # its env: variant (an EnvSettings subclass, marked @section); None: kind alone
    cli: str = ""                        # module of `neon-hpc <name> ...` ("" = none)
    cli_help: str = ""
    resume: str = "replay"               # how a journalled episode's environment comes back (RESUME_MODES)
