"""Deterministic grading of a phase-identification answer.

Thresholds (and why):

- ``MAJOR = 0.05``: a phase under 5 wt% is near the detection limit of a lab powder
  pattern; missing or inventing one does not fail an answer.
- ``TOL = 0.10`` (strict ``0.05``): quantitative phase analysis without standards is good to
  a few wt% at best, and the synthetic truth ignores microabsorption; +-10 wt% separates a
  right quantification from a wrong one without demanding Rietveld-grade accuracy.
- ``STRAIN_WINDOW = 0.03``: two library entries with the same reduced formula and space group
  whose lattice parameters agree within 3% are the same phase (solid solutions, different
  refinements, AFLOW vs curated copies).

success = every true phase >= MAJOR is predicted, no predicted phase >= MAJOR is absent from
the truth, and every true fraction is matched within TOL (a true phase that is not predicted
counts as predicted 0).

dense (for RL, in [0, 1]) = F1 over major phases x (1 - TV), where TV is the total variation
distance between the predicted and true weight distributions (half the L1 distance over the
union of phases).  Rewards both naming the right phases and getting the amounts.

Predicted phases may be named by library id ("cur:TiO2_rutile"), by formula ("TiO2"), or by
formula and space group ("TiO2 P4_2/mnm", "TiO2:136", "TiO2 (P4_2/mnm)").  A formula alone
matches a true phase only when the truth has exactly one phase of that formula (it cannot tell
anatase from rutile); a truth given by formula alone (real data: "TiO2") collects every
predicted phase of that formula.  Fractions may be given as fractions or as percent (a total
above 1.5 is read as percent); they are renormalised to sum to 1.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from neon_hpc.envs.xrd.science.library import Library, load_library, normalize_formula

MAJOR = 0.05
TOL = 0.10
STRICT_TOL = 0.05
STRAIN_WINDOW = 0.03


@dataclass
class Grade:
    success: bool
    dense: float
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Key:
    formula: str                      # normalized
    sg_number: int | None             # None = any polymorph
    lattice: tuple | None             # (a, b, c) for the strain window, if known
    label: str


def _sg_number(text: str) -> int | None:
    text = text.strip().strip("()[]").strip()
    if not text:
        return None
    if text.isdigit():
        return int(text)
    try:
        from pymatgen.symmetry.groups import SpaceGroup  # deferred: heavy (pymatgen)
        return int(SpaceGroup(text).int_number)
    except Exception:
        raise ValueError(f"unknown space group {text!r}; use a number (136) or a symbol (P4_2/mnm)") from None


def phase_key(name: str, lib: Library) -> _Key:
    """What a name refers to: a library id, or a formula with an optional space group."""
    name = str(name).strip()
    if name in lib:
        p = lib.get(name)
        return _Key(normalize_formula(p.formula), p.sg_number, tuple(round(v, 4) for v in p.lattice_params[:3]), name)
    m = re.match(r"^([A-Za-z0-9().]+)\s*(?:[:@ ]\s*(.+))?$", name)
    if not m:
        raise ValueError(f"cannot read phase {name!r}: give a library id, a formula, or 'formula spacegroup'")
    formula = normalize_formula(m.group(1))
    sg = _sg_number(m.group(2)) if m.group(2) else None
    return _Key(formula, sg, None, name)


def _same_phase(pred: _Key, true: _Key) -> bool:
    if pred.formula != true.formula:
        return False
    if pred.sg_number is None or true.sg_number is None:
        return True
    if pred.sg_number != true.sg_number:
        return False
    if pred.lattice and true.lattice:
        return all(abs(a / b - 1) <= STRAIN_WINDOW for a, b in zip(sorted(pred.lattice), sorted(true.lattice)))
    return True


def _normalise(fracs: list[float]) -> list[float]:
    total = sum(max(0.0, f) for f in fracs)
    if total <= 0:
        return [0.0 for _ in fracs]
    if total > 1.5:          # percent
        fracs = [f / 100.0 for f in fracs]
        total /= 100.0
    return [max(0.0, f) / total for f in fracs]


def grade(predicted: list[tuple[str, float]], truth, strict: bool = False, library: Library | None = None) -> Grade:
    """Grade ``predicted`` [(phase, weight fraction)] against ``truth`` [(phase_id, formula, wf)].

    Never raises on a malformed prediction: unreadable phases are reported in ``details`` and
    count as spurious.
    """
    lib = library or load_library()
    tol = STRICT_TOL if strict else TOL
    true_keys, true_w = [], []
    for pid, formula, wf in truth:
        key = phase_key(pid, lib) if pid and pid in lib else phase_key(formula, lib)
        true_keys.append(key)
        true_w.append(float(wf))
    true_w = _normalise(true_w)

    errors, pred_keys, raw_w = [], [], []
    for item in predicted or []:
        try:
            name, wf = item
            key, w = phase_key(name, lib), float(wf)
            if not math.isfinite(w):
                raise ValueError("weight fraction is not a finite number")
            pred_keys.append(key)
            raw_w.append(w)
        except Exception as e:   # noqa: BLE001 - a bad answer is graded, not crashed on
            errors.append(f"{item!r}: {e}")
    pred_w = _normalise(raw_w)

    # assign each predicted phase to at most one true phase
    assigned = [None] * len(pred_keys)
    for i, pk in enumerate(pred_keys):
        matches = [j for j, tk in enumerate(true_keys) if _same_phase(pk, tk)]
        if pk.sg_number is None and len(matches) > 1:
            matches = []       # formula alone cannot pick a polymorph
        if matches:
            assigned[i] = matches[0]
    got = [0.0] * len(true_keys)
    for i, j in enumerate(assigned):
        if j is not None:
            got[j] += pred_w[i]
    spurious = [(pred_keys[i].label, round(pred_w[i], 4)) for i, j in enumerate(assigned) if j is None]

    missed_major = [true_keys[j].label for j in range(len(true_keys)) if true_w[j] >= MAJOR and got[j] <= 0]
    spurious_major = [lab for lab, w in spurious if w >= MAJOR]
    frac_err = [abs(got[j] - true_w[j]) for j in range(len(true_keys))]
    off = [true_keys[j].label for j, e in enumerate(frac_err) if e > tol + 1e-9]
    success = not missed_major and not spurious_major and not off and not errors

    tp = sum(1 for j in range(len(true_keys)) if true_w[j] >= MAJOR and got[j] >= MAJOR)
    n_true = sum(1 for w in true_w if w >= MAJOR)
    n_pred = sum(1 for w in got if w >= MAJOR) + len(spurious_major)
    f1 = 0.0 if tp == 0 else 2 * tp / (n_true + n_pred)
    tv = 0.5 * (sum(frac_err) + sum(w for _, w in spurious))
    dense = max(0.0, min(1.0, f1 * (1.0 - tv)))
    return Grade(success=success, dense=dense, details={
        "f1_major": f1, "tv_distance": tv, "abs_errors": {true_keys[j].label: round(frac_err[j], 4)
                                                          for j in range(len(true_keys))},
        "predicted_matched": {true_keys[j].label: round(got[j], 4) for j in range(len(true_keys))},
        "missed_major": missed_major, "spurious": spurious, "spurious_major": spurious_major,
        "fraction_off": off, "unreadable": errors, "tolerance": tol, "major": MAJOR,
        "assignment": [None if j is None else true_keys[j].label for j in assigned],   # per readable predicted phase
        "mae": sum(frac_err) / max(1, len(frac_err))})
