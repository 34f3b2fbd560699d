"""The real measured patterns (``shared/data/xrd-real``, Dara benchmark, MIT): records and tasks.

Found at ``$NEON_XRD_REAL_DATA`` or ``<repo root>/../shared/data/xrd-real`` (CI clones the repo
with ``shared/`` beside it).  Nothing from it is copied into the repository.

- ``precursor_mixture/``: the file name is the truth (``NiO_0p1031-La(OH)3_0p2025-...--8min``);
  the polymorph is not stated, so formulas whose polymorph the README fixes get a phase id
  (monoclinic ZrO2, alpha-Bi2O3, ...) and TiO2 stays formula-only (anatase and/or rutile).
- ``binary_reactions/``: products of two-precursor reactions, unlabelled: records with
  conditions, for the agent's history and as realistic inputs, never scored.

The record date is the scan's start date; both scans of one mixture share the earlier date, so
one scan never reveals the other's label.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from neon_hpc.envs.xrd.science.library import parse_formula
from neon_hpc.envs.xrd.science.readers import read_xrdml
from neon_hpc.envs.xrd.science.tasks import Pattern, Task

ENV_VAR = "NEON_XRD_REAL_DATA"

# formula in a file name -> library phase id (None: polymorph not fixed, graded by formula)
REAL_PHASE_IDS = {
    "NiO": "cur:NiO_bunsenite", "ZnO": "cur:ZnO_zincite", "In2O3": "cur:In2O3_bixbyite",
    "MnCO3": "cur:MnCO3_rhodochrosite", "Li2CO3": "cur:Li2CO3_zabuyelite", "ZrO2": "cur:ZrO2_baddeleyite",
    "La(OH)3": "cur:LaOH3", "Bi2O3": "cur:Bi2O3_alpha", "V2O5": "cur:V2O5_shcherbinaite", "TiO2": None,
}


def real_data_dir(override: str | Path | None = None) -> Path | None:
    """The xrd-real folder: ``override`` (e.g. ``--data``), ``$NEON_XRD_REAL_DATA``, or beside the repo."""
    env = str(override) if override else os.environ.get(ENV_VAR)
    repo_root = Path(__file__).resolve().parents[2]        # == Path(neon_hpc.__file__).parents[1]
    path = Path(env) if env else repo_root.parent / "shared" / "data" / "xrd-real"
    return path if path.is_dir() else None


def parse_mixture_name(stem: str) -> tuple[list[tuple[str, float]], str]:
    """'NiO_0p6007-Bi2O3_0p4008--8min' -> ([('NiO', 0.6007), ('Bi2O3', 0.4008)], '8min')."""
    body, _, scan = stem.partition("--")
    out = []
    for part in body.split("-"):
        m = re.fullmatch(r"(.+)_(\d+)p(\d+)", part)
        if not m:
            raise ValueError(f"{stem}: cannot read phase and weight from {part!r}")
        out.append((m.group(1), float(f"{m.group(2)}.{m.group(3)}")))
    return out, scan


def parse_reaction_name(stem: str) -> tuple[list[str], dict]:
    """'2Fe3O4-3Y2O3_1000C_60min' -> (['Fe3O4', 'Y2O3'], {temperature_C: 1000, time_min: 60, ...})."""
    m = re.fullmatch(r"(.+)_(\d+)C_(\d+)min", stem)
    if not m:
        raise ValueError(f"{stem}: expected precursors_TTTC_NNmin")
    precursors = [re.sub(r"^\d+", "", p) for p in m.group(1).split("-")]
    return precursors, {"temperature_C": int(m.group(2)), "time_min": int(m.group(3)), "atmosphere": "air",
                        "procedure": "two-precursor reaction, autonomous lab"}


def _scan_date(path: Path) -> str:
    text = path.read_text(errors="replace")
    m = re.search(r"<startTimeStamp>(\d{4}-\d{2}-\d{2})", text)
    return m.group(1) if m else "2024-01-01"


def _elements(formulas) -> list[str]:
    return sorted({e for f in formulas for e in parse_formula(f)})


@functools.lru_cache(maxsize=2)
def _real_entries(root: str) -> tuple:
    base = Path(root)
    entries = []
    mixtures = sorted((base / "precursor_mixture").glob("*.xrdml"))
    first_date: dict[str, str] = {}
    for f in mixtures:
        key = f.stem.partition("--")[0]
        d = _scan_date(f)
        first_date[key] = min(d, first_date.get(key, d))
    for f in mixtures:
        phases, scan = parse_mixture_name(f.stem)
        entries.append(("precursor_mixture", f, first_date[f.stem.partition("--")[0]], phases, scan))
    for f in sorted((base / "binary_reactions").glob("*.xrdml")):
        entries.append(("binary_reactions", f, _scan_date(f), None, ""))
    return tuple(entries)


def real_records(with_patterns: bool = True) -> list[dict]:
    """Store records of every real pattern (labelled where the file name gives the truth)."""
    root = real_data_dir()
    if root is None:
        return []
    out = []
    for kind, f, date, phases, scan in _real_entries(str(root)):
        m = read_xrdml(f) if with_patterns else None
        if phases is not None:
            formulas = [p for p, _ in phases]
            rec = {"precursors": formulas, "elements": _elements(formulas),
                   "conditions": {"procedure": "weighed precursor mixture", "scan": scan},
                   "phases": [{"phase_id": REAL_PHASE_IDS.get(p), "formula": p, "weight_fraction": w}
                              for p, w in phases]}
        else:
            precursors, conditions = parse_reaction_name(f.stem)
            rec = {"precursors": precursors, "elements": _elements(precursors), "conditions": conditions,
                   "phases": None}
        rec.update(sample_id=f"real:{kind}:{f.stem}", date=date, source=f"real:{kind}",
                   two_theta=None if m is None else m.two_theta, intensity=None if m is None else m.intensity)
        out.append(rec)
    return out


def load_real_tasks(kind: str = "precursor_mixture", scan: str | None = None, data_dir: str | Path | None = None,
                    measured: bool = False):
    """Real patterns as :class:`~neon_hpc.envs.xrd.science.tasks.Task` (split ``real_dev`` or ``real_reactions``).

    ``measured``: mark them ``instrument["measured"]`` so that fits model anomalous scattering and
    (outside a protocol) the prior's Brindley radius (``Instrument.measured``).  The baseline then
    identifies without f', f'' and quantifies the found phases with them; its evaluations
    (``neon-hpc xrd eval --data``, ``tools/bench_xrd.py``) pass ``measured=True`` by default.  The
    argument stays off by default here because the agent's ``fit_phases`` would identify with f', f''
    too, which no leave-one-mixture-out run has tested (README, "Anomalous scattering").
    """
    root = Path(data_dir) if data_dir else real_data_dir()
    if root is None or not root.is_dir():
        raise FileNotFoundError(f"real XRD data not found; set {ENV_VAR} or place shared/ beside the repository")
    tasks = []
    for k, f, date, phases, sc in _real_entries(str(root)):
        if k != kind or (scan and sc != scan):
            continue
        m = read_xrdml(f)
        if phases is not None:
            formulas = [p for p, _ in phases]
            truth = [(REAL_PHASE_IDS.get(p) or "", p, w) for p, w in phases]
            conditions = {"procedure": "weighed precursor mixture", "scan": sc}
        else:
            formulas, conditions = parse_reaction_name(f.stem)
            truth = []
        els = _elements(formulas)
        tasks.append(Task(id=f"real:{k}:{f.stem}", date=date, chemical_system="-".join(els), elements=els,
                          precursors=formulas, conditions=conditions,
                          pattern=Pattern(m.two_theta, m.intensity), truth=truth,
                          split="real_dev" if phases is not None else "real_reactions", preset="real",
                          instrument={"wavelength": m.wavelength, "wavelength2": m.wavelength2,
                                      "ka2_ratio": m.ka2_ratio, "measured": bool(measured)}))
    return tasks
