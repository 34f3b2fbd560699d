"""The XRD task as an agent environment: prompts, tools, answer reading, grading.

Two prompt styles:

- ``full`` (real models): a system prompt with the task, the answer format and the tools'
  JSON schemas; a user message with the sample (elements, precursors, synthesis conditions,
  date, a summary of the pattern with its strongest peaks, and a pointer to the lab's history,
  reachable through tools).  Tool calls in JSON; answer ``<answer>phase fraction, ...</answer>``.
- ``compact`` (the tiny model of ``configs/tiny_cpu.yaml``, vocabulary of 256 tokens): one
  line, ``elements Ni O Ti peaks 27 37 43 54 63 candidates NiO 43 TiO2 27 TiO2 25 ...``: the
  observed strongest peak positions and the candidate phases (those ``search_phases`` returns
  for the sample's elements, distractors included) each with the position of its strongest
  reflection, all as single tokens.  The answer names phases by those positions:
  ``<answer>43 27</answer>`` -> the candidates listed at 43 and at 27 (equal fractions).  Every
  number must be a listed candidate's position: an answer with any other number names nothing
  and scores 0, so a constant answer is right only on the tasks where it is (issue 31: with the
  nearest candidate instead, one constant answer scored 0.47 on the eval set).  A name (formula
  or id) is also accepted.  ``auto`` picks ``compact`` for the ``tiny`` preset.  The config key
is ``env.prompt_style`` (``neon-hpc xrd eval --prompt-style``).

Tools are ``neon_hpc.envs.xrd.science.tools`` (``env.tools``, ``--tools full|minimal``); their errors come back as
``{"error": ...}`` and are shown to the model.  Grading is ``neon_hpc.envs.xrd.science.grader.grade``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import numpy as np

from neon_hpc.envs.xrd.answer import parse_phase_answer
from neon_hpc.envs.xrd.science.grader import grade
from neon_hpc.envs.xrd.science.tasks import make_context
from neon_hpc.envs.xrd.science.tools import call_tool, observed_peaks, refit, toolset
from neon_hpc.rollout.agent.parse import ToolCall
from neon_hpc.util.bounded import clip_text, short_repr

ANSWER_FORMAT = ("Answer with <answer>PHASE FRACTION, PHASE FRACTION</answer>, naming each phase by its "
                 "library id (from search_phases) or as 'formula spacegroup', with weight fractions "
                 "summing to 1 (or percent), e.g. <answer>cur:TiO2_rutile 0.7, cur:ZnO_zincite 0.3</answer>.")
COMPACT_MAX_PHASES = 3


class XRDEnv:
    """One XRD task (``neon_hpc.envs.xrd.science.tasks.Task``) for one episode."""

    def __init__(self, task: Any, tools: str = "full", style: str = "auto", max_tool_chars: int = 2000):
        self.task = task
        self.task_id = str(task.id)
        self.tools = toolset(tools)
        self.style = ("compact" if task.preset == "tiny" else "full") if style == "auto" else style
        self.max_tool_chars = max_tool_chars if self.style == "full" else min(max_tool_chars, 240)
        self.ctx = make_context(task)
        self._candidates: list[tuple[str, str, float]] | None = None   # (id, formula, strongest 2theta)

    @classmethod
    def configured(cls, task: Any, settings: Any, rollout_cfg: Any) -> "XRDEnv":
        """The episode environment as the config sets it: tools and prompt style from the ``env:``
        section of kind xrd (``settings``), the tool text clip from the rollout section."""
        return cls(task, tools=settings.tools, style=settings.prompt_style, max_tool_chars=rollout_cfg.max_tool_chars)

    # --- prompts -----------------------------------------------------------------------
    def system_text(self) -> str:
        if self.style == "compact":
            return "xrd"
        schemas = json.dumps([t.openai_schema()["function"] for t in self.tools.values()], separators=(",", ":"))
        return ("You identify the crystalline phases in a powder X-ray diffraction pattern and their weight "
                "fractions. Use the tools to inspect the pattern, search candidate phases, simulate and fit "
                "them. Call one tool per message as <tool_call>{\"name\": NAME, \"arguments\": {...}}"
                "</tool_call>. " + ANSWER_FORMAT + " Tools: " + schemas)

    def task_text(self) -> str:
        return self._compact_task() if self.style == "compact" else self._full_task()

    def _observed_peaks(self, n: int) -> list[tuple[float, float]]:
        x, h, _ = observed_peaks(self.ctx.two_theta, self.ctx.intensity)
        top = np.argsort(-h)[:n]
        return sorted((float(x[i]), float(h[i])) for i in top)

    def candidates(self) -> list[tuple[str, str, float]]:
        if self._candidates is None:
            res = call_tool("search_phases", {"elements": list(self.task.elements), "limit": 12}, self.ctx)
            cands = []
            for p in res.get("phases", []):
                if p.get("strongest_peaks"):
                    tt = max(p["strongest_peaks"], key=lambda z: z[1])[0]
                    cands.append((p["id"], p["formula"], float(tt)))
            self._candidates = cands
        return self._candidates

    def _compact_task(self) -> str:
        peaks = " ".join(str(int(round(x))) for x, _ in self._observed_peaks(5))
        cands = " ".join(f"{f} {int(round(tt))}" for _pid, f, tt in self.candidates())
        return f"elements {' '.join(self.task.elements)} peaks {peaks} candidates {cands}"

    def _full_task(self) -> str:
        t = self.task
        x = self.ctx.two_theta
        peaks = ", ".join(f"{a:.2f} ({h:.0f}%)" for a, h in self._observed_peaks(10))
        lines = [f"Sample {sample_label(t.id)}, measured {t.date}.",
                 f"Elements: {', '.join(t.elements)}." if t.elements else "",
                 f"Precursors: {', '.join(t.precursors)}." if t.precursors else "",
                 f"Synthesis: {json.dumps(t.conditions)}." if t.conditions else "",
                 f"Pattern: 2theta {x[0]:.1f}-{x[-1]:.1f} deg, {len(x)} points, wavelength "
                 f"{self.ctx.instrument.wavelength} A. Strongest peaks (2theta, relative height): {peaks}.",
                 "Earlier experiments of this lab (before this date) are available through search_history."
                 if "search_history" in self.tools else "",
                 "Which phases are present, and in what weight fractions?"]
        return "\n".join(s for s in lines if s)

    # --- tools -------------------------------------------------------------------------
    def run_tool(self, call: ToolCall) -> dict:
        spec = self.tools.get(call.name)
        args = dict(call.arguments)
        if call.positional:
            if spec is None:
                return {"error": f"unknown tool {short_repr(call.name, 80)}; available: {', '.join(self.tools)}"}
            bound = _bind_positional(spec.parameters, call.positional)
            if isinstance(bound, str):
                return {"error": f"{call.name}: {bound}"}
            args = {**bound, **args}
        return call_tool(call.name, args, self.ctx, self.tools)

    # --- the journal's snapshot ---------------------------------------------------------
    def snapshot(self) -> dict:
        """The episode's state, JSON-able: what the tools remember (the last fit's phases and
        whether it refined, the plots made) and the candidates the prompt listed."""
        last = self.ctx.cache.get("_last_fit_args")
        return {"task_id": self.task_id, "tools": sorted(self.tools), "style": self.style,
                "last_fit": list(last) if last else None, "plots": int(self.ctx.cache.get("_plots", 0)),
                "candidates": [list(c) for c in self._candidates] if self._candidates is not None else None}

    def restore(self, state: dict) -> None:
        """Make this fresh environment of the same task equal to the one snapshotted: the last fit
        is redone (deterministic: the same phases, the same refinement)."""
        if state.get("task_id") != self.task_id or state.get("tools") != sorted(self.tools):
            raise ValueError(f"snapshot of {state.get('task_id')!r} with tools {state.get('tools')} does not fit "
                             f"XRD task {self.task_id!r} with tools {sorted(self.tools)}")
        if state.get("candidates") is not None:
            self._candidates = [(str(a), str(b), float(c)) for a, b, c in state["candidates"]]
        if state.get("last_fit"):
            ids, refine = state["last_fit"]
            refit(self.ctx, list(ids), bool(refine))
        if state.get("plots"):
            self.ctx.cache["_plots"] = int(state["plots"])

    def format_result(self, result: dict) -> str:
        text = json.dumps(result, separators=(",", ":"), default=str)
        return clip_text(text, self.max_tool_chars)   # the marker says how much was cut

    # --- answers -----------------------------------------------------------------------
    def parse_answer(self, text: str | None) -> list[tuple[str, float]]:
        if text is None:
            return []
        if self.style == "compact":
            picked = self._compact_answer(text)
            if picked:
                return picked
        return parse_phase_answer(text)

    def _compact_answer(self, text: str) -> list[tuple[str, float]]:
        """Phases named by the candidate positions the prompt shows; [] unless every number is one.

        A number names the candidate listed at that (rounded) position, the first one listed where
        two share it; a number that is no candidate's position makes the text no compact answer
        (it is then read as names, and an unreadable name scores nothing): a constant answer is
        right only where it is, not wherever it happens to be nearest to the right candidate.
        """
        at: dict[int, str] = {}
        for pid, _formula, tt in self.candidates():
            at.setdefault(int(round(tt)), pid)
        chosen: list[str] = []
        for m in re.finditer(r"\d+(?:\.\d+)?", text):
            pid = at.get(int(m.group(0))) if m.group(0).isdigit() else None
            if pid is None:
                return []
            if pid not in chosen:
                chosen.append(pid)
            if len(chosen) == COMPACT_MAX_PHASES:
                break
        return [(pid, 1.0 / len(chosen)) for pid in chosen]

    def grade(self, predicted: list[tuple[str, float]]) -> tuple[float, float, dict]:
        g = grade(predicted or [], self.task.truth)
        details = dict(g.details)
        details["phase_f1"] = details.get("f1_major")
        details["weight_mae"] = details.get("mae")
        return float(g.success), float(g.dense), details


def sample_label(task_id: str) -> str:
    """An opaque name for the prompt: real task ids are file names that spell out the answer."""
    return "S" + hashlib.sha256(task_id.encode()).hexdigest()[:10]


def _bind_positional(schema: dict, positional: list) -> dict | str:
    """Compact calls: bare words go to the required parameters in order, or (no required
    parameter) to the first array parameter, e.g. ``search_phases Ti O`` -> elements."""
    props = schema.get("properties", {})
    required = list(schema.get("required", []))
    if required:
        target = required[0]
    else:
        arrays = [k for k, v in props.items() if v.get("type") == "array"]
        if not arrays:
            return "takes no positional arguments; write key=value"
        target = arrays[0]
    if props.get(target, {}).get("type") == "array":
        return {target: [str(p) if not isinstance(p, (int, float)) else p for p in positional]}
    if len(positional) > len(required):
        return f"too many positional arguments ({len(positional)}); parameters: {', '.join(required)}"
    return dict(zip(required, positional))
