"""Reading a phase answer: text -> ``[(phase, weight_fraction), ...]`` for the XRD grader.

Accepted spellings (what a model may reasonably write):

- JSON: ``[["TiO2 P4_2/mnm", 0.6], ["ZnO", 0.4]]``, ``[{"phase": "ZnO", "fraction": 40}]``,
  ``{"ZnO": 40, "NiO": 60}``;
- text: items separated by ``,`` ``;`` or newlines, each a phase name (library id, formula,
  or formula and space group) optionally followed by a number (fraction or percent, ``%``
  and ``wt%`` allowed): ``TiO2 P4_2/mnm 60%, ZnO 40``.  Items without a number share what
  the numbered ones leave (all of it when none is numbered).
- candidate labels (compact prompts list candidates as ``A``, ``B``, ...): a label maps to
  its phase id; the first label found wins (one phase, fraction 1).

Unreadable answers give ``[]`` (graded as no phases, never a crash).
"""

from __future__ import annotations

import json
import re

_NUM = re.compile(r"^(-?\d+(?:\.\d+)?)\s*(?:wt\s*%|%)?$")
_TRAILING_NUM = re.compile(r"^(.*?)[\s:=]+(-?\d+(?:\.\d+)?)\s*(?:wt\s*%|%)?$")


def parse_phase_answer(text: str | None, labels: dict[str, str] | None = None) -> list[tuple[str, float]]:
    if text is None:
        return []
    text = text.strip()
    if labels:
        picked = pick_label(text, labels)
        if picked is not None:
            return [(picked, 1.0)]
    if text[:1] in "[{":
        parsed = _from_json(text)
        if parsed is not None:
            return parsed
    return _from_text(text)


def pick_label(text: str, labels: dict[str, str]) -> str | None:
    """The phase of the first candidate label in ``text`` (a standalone label, or at the start)."""
    for m in re.finditer(r"[A-Za-z0-9:_]+", text):
        word = m.group(0)
        if word in labels:
            return labels[word]
    return None


def _from_json(text: str) -> list[tuple[str, float]] | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    items: list[tuple[str, float | None]] = []
    if isinstance(obj, dict) and "phases" in obj:
        obj = obj["phases"]
    if isinstance(obj, dict):
        items = [(str(k), _num(v)) for k, v in obj.items()]
    elif isinstance(obj, list):
        for it in obj:
            if isinstance(it, (list, tuple)) and it:
                items.append((str(it[0]), _num(it[1]) if len(it) > 1 else None))
            elif isinstance(it, dict):
                name = it.get("phase") or it.get("name") or it.get("id") or it.get("formula")
                frac = next((it[k] for k in ("fraction", "weight_fraction", "wt", "wt%", "weight")
                             if k in it), None)
                if name is not None:
                    items.append((str(name), _num(frac)))
            elif isinstance(it, str):
                items.append((it, None))
    else:
        return None
    return _fill(items)


def _from_text(text: str) -> list[tuple[str, float]]:
    items: list[tuple[str, float | None]] = []
    for part in re.split(r"[,;\n]+", text):
        part = part.strip().strip(".")
        if not part:
            continue
        m = _TRAILING_NUM.match(part)
        if m and m.group(1).strip():
            items.append((m.group(1).strip(), float(m.group(2))))
        elif not _NUM.match(part):
            items.append((part, None))
    return _fill(items)


def _num(v) -> float | None:
    try:
        return float(str(v).rstrip("%").replace("wt", "").strip())
    except (TypeError, ValueError):
        return None


def _fill(items: list[tuple[str, float | None]]) -> list[tuple[str, float]]:
    """Give unnumbered items an equal share of what the numbered ones leave."""
    if not items:
        return []
    known = [f for _, f in items if f is not None]
    scale = 100.0 if sum(known) > 1.5 else 1.0
    rest = max(0.0, scale - sum(known))
    n_missing = sum(1 for _, f in items if f is None)
    share = rest / n_missing if n_missing else 0.0
    return [(name, f if f is not None else share) for name, f in items]
