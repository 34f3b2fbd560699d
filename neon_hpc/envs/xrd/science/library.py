"""The phase library: crystal structures with provenance, built offline, loaded without pymatgen.

Sources (each phase keeps ``source``, ``reference``, ``year`` and ``license``):

| source        | what                                                        | licence of the source |
|---------------|-------------------------------------------------------------|-----------------------|
| ``curated``   | ``curated.py``: well-known phases from published structures  | facts; entries ours (Apache-2.0) |
| ``aflow``     | pymatgen's bundled AFLOW prototype library (288 structures,  | pymatgen: MIT; data of the AFLOW     |
|               | each with its literature reference and year)                 | Library of Crystallographic          |
|               |                                                              | Prototypes (Mehl et al. 2017)        |
| ``ase``       | ase's elemental reference states (Ashcroft & Mermin)         | ase: LGPL-2.1+        |
| ``substitution`` | prototypes with their cation replaced, lattice scaled by ionic radii:  | derived here |
|                  | distractors only, never answers (``answer_eligible=False``)            |              |

Junk is filtered by explicit rules (:func:`junk_reason`): noble gases and other elements that are
gases at room temperature as elemental solids, molecular solids of gases (CO, NH3, SiF4, ...) and
high-pressure-only phases (H3S), elements without stable isotopes (except Th, U),
more than 4 distinct elements (alloy approximants), elements without X-ray form factors,
atoms closer than 0.5 A.  Duplicates (same reduced formula and space-group number) keep the
first by source priority curated > aflow > ase > substitution.

The built library lives in ``data/phases.json`` (rebuild: ``python -m neon_hpc.envs.xrd.science.library``);
:func:`load_library` reads it in milliseconds.  Phase ids are stable strings:
``cur:<key>``, ``aflow:<aflow label>``, ``ase:<element>``, ``sub:<formula>:<prototype>``.
"""
from __future__ import annotations

import functools
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neon_hpc.envs.xrd.science.curated import CURATED

DATA_DIR = Path(__file__).with_name("data")
LIBRARY_JSON = DATA_DIR / "phases.json"

NOBLE_GASES = {"He", "Ne", "Ar", "Kr", "Xe", "Rn"}
GASEOUS_ELEMENTS = {"H", "N", "O", "F", "Cl"} | NOBLE_GASES     # junk as elemental solids
NO_STABLE_ISOTOPE = {"Tc", "Pm", "Po", "At", "Rn", "Fr", "Ra", "Ac", "Pa", "Np", "Pu", "Am", "Cm",
                     "Bk", "Cf", "Es", "Fm", "Md", "No", "Lr"}
# molecular solids of room-temperature gases, and a high-pressure-only hydride: not lab phases
MOLECULAR_OR_HIGH_PRESSURE = {"CO", "CO2", "H3N", "H3S", "H2S", "SiF4", "CNCl", "HC", "CH4", "HCl", "NO", "N2O"}
MAX_ELEMENTS = 4
MIN_DISTANCE_A = 0.5
SOURCE_PRIORITY = {"curated": 0, "aflow": 1, "ase": 2, "substitution": 3}

# molar masses (g/mol) of the elements we may meet; filled lazily from pymatgen at build time and
# stored per phase as ``cell_mass`` so that loading never needs pymatgen.
AVOGADRO = 6.02214076e23


@dataclass(frozen=True)
class Phase:
    id: str
    formula: str                 # reduced formula, pymatgen style ("TiO2", "La(OH)3" -> "La(HO)3")
    spacegroup: str
    sg_number: int
    elements: tuple[str, ...]    # sorted symbols
    year: int                    # publication year of the structure: visible to tasks dated after it
    source: str
    reference: str
    license: str
    density: float               # g/cm^3
    cell_mass: float             # g/mol of the cell's atoms (Z*M), for weight fractions
    volume: float                # A^3 of the cell
    lattice: tuple[tuple[float, float, float], ...]   # 3x3 row vectors, Angstrom
    species: tuple[str, ...]
    frac_coords: tuple[tuple[float, float, float], ...]
    answer_eligible: bool = True
    name: str = ""               # mineral or common name
    display_formula: str = ""    # formula as chemists write it ("La(OH)3")

    @property
    def chemsys(self) -> str:
        return "-".join(self.elements)

    @property
    def lattice_params(self) -> tuple[float, ...]:
        m = np.asarray(self.lattice)
        a, b, c = np.linalg.norm(m, axis=1)
        ang = lambda u, v: math.degrees(math.acos(float(np.dot(u, v) / np.linalg.norm(u) / np.linalg.norm(v))))
        return (a, b, c, ang(m[1], m[2]), ang(m[0], m[2]), ang(m[0], m[1]))

    def summary(self) -> dict:
        a, b, c, al, be, ga = self.lattice_params
        return {"id": self.id, "formula": self.display_formula or self.formula, "spacegroup": self.spacegroup,
                "sg_number": self.sg_number, "name": self.name, "year": self.year, "source": self.source,
                "density": round(self.density, 3),
                "lattice": [round(v, 4) for v in (a, b, c, al, be, ga)],
                "answer_eligible": self.answer_eligible}

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["elements"] = list(self.elements)
        d["lattice"] = [list(r) for r in self.lattice]
        d["species"] = list(self.species)
        d["frac_coords"] = [list(r) for r in self.frac_coords]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Phase":
        d = dict(d)
        d["elements"] = tuple(d["elements"])
        d["lattice"] = tuple(tuple(r) for r in d["lattice"])
        d["species"] = tuple(d["species"])
        d["frac_coords"] = tuple(tuple(r) for r in d["frac_coords"])
        return cls(**d)

    def structure(self):
        """The pymatgen Structure (imports pymatgen; used by validation and tools that need it)."""
        from pymatgen.core import Lattice, Structure  # deferred: heavy (pymatgen)
        return Structure(Lattice(self.lattice), list(self.species), list(self.frac_coords))


class Library:
    """Phases by id, with look-ups by formula and elements."""

    def __init__(self, phases: list[Phase]):
        self.phases = list(phases)
        self.by_id = {p.id: p for p in self.phases}
        if len(self.by_id) != len(self.phases):
            raise ValueError("phase library: duplicate phase ids")
        self._by_formula: dict[str, list[Phase]] = {}
        for p in self.phases:
            self._by_formula.setdefault(normalize_formula(p.formula), []).append(p)

    def __len__(self) -> int:
        return len(self.phases)

    def __contains__(self, pid: str) -> bool:
        return pid in self.by_id

    def get(self, pid: str) -> Phase:
        try:
            return self.by_id[pid]
        except KeyError:
            raise KeyError(f"unknown phase id {pid!r}; search_phases lists valid ids") from None

    def by_formula(self, formula: str) -> list[Phase]:
        return list(self._by_formula.get(normalize_formula(formula), []))

    def within(self, elements, max_year: int | None = None, answers_only: bool = False) -> list[Phase]:
        """Phases made only of ``elements`` (a subset of them), published before ``max_year``."""
        allowed = set(elements)
        return [p for p in self.phases if set(p.elements) <= allowed
                and (max_year is None or p.year < max_year)
                and (p.answer_eligible or not answers_only)]


def normalize_formula(formula: str) -> str:
    """Reduced formula in a canonical form ("La(OH)3" == "LaH3O3" == "La(HO)3"), element-sorted."""
    counts = parse_formula(formula)
    if not counts:
        raise ValueError(f"not a chemical formula: {formula!r}")
    g = 0
    for v in counts.values():
        g = math.gcd(g, int(round(v * 1000)))
    parts = []
    for el in sorted(counts):
        n = counts[el] * 1000 / g
        parts.append(el + (f"{n:g}" if abs(n - 1) > 1e-9 else ""))
    return "".join(parts)


_TOKEN = re.compile(r"([A-Z][a-z]?|\(|\)|\d+(?:\.\d+)?)")


def parse_formula(formula: str) -> dict[str, float]:
    """Element counts of a formula with parentheses ("La(OH)3" -> {La: 1, O: 3, H: 3})."""
    text = formula.replace(" ", "")
    tokens = _TOKEN.findall(text)
    if not text or "".join(tokens) != text:
        raise ValueError(f"not a chemical formula: {formula!r}")

    def count_at(i: int) -> tuple[float, int]:
        if i < len(tokens) and tokens[i][0].isdigit():
            return float(tokens[i]), i + 1
        return 1.0, i

    stack: list[dict[str, float]] = [{}]
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "(":
            stack.append({})
            continue
        if tok == ")":
            if len(stack) == 1:
                raise ValueError(f"unbalanced parentheses in {formula!r}")
            n, i = count_at(i)
            for el, k in stack.pop().items():
                stack[-1][el] = stack[-1].get(el, 0) + k * n
            continue
        if tok[0].isdigit():
            raise ValueError(f"number without an element in {formula!r}")
        if tok not in _ELEMENT_SET:
            raise ValueError(f"unknown element {tok!r} in {formula!r}")
        n, i = count_at(i)
        stack[-1][tok] = stack[-1].get(tok, 0) + n
    if len(stack) != 1:
        raise ValueError(f"unbalanced parentheses in {formula!r}")
    return stack[0]


_ELEMENT_SET = set(
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr "
    "Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb "
    "Lu Hf Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr".split())


ELEMENT_SYMBOLS = frozenset(_ELEMENT_SET)


@functools.lru_cache(maxsize=4)
def load_library(path: str | None = None) -> Library:
    """The shipped library (``data/phases.json``); fast, no pymatgen import."""
    p = Path(path) if path else LIBRARY_JSON
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: phase library missing; rebuild it with "
                                "`python -m neon_hpc.envs.xrd.science.library`") from None
    return Library([Phase.from_json(d) for d in raw["phases"]])


# ----------------------------------------------------------------------------------------------
# building (needs pymatgen / ase; run offline, result committed as data/phases.json)

def junk_reason(elements: list[str], min_distance: float, has_form_factors: bool,
                formula: str = "") -> str | None:
    """Why a structure is excluded, or None.  The rules are explicit so reviewers can audit them."""
    els = set(elements)
    if formula and formula in MOLECULAR_OR_HIGH_PRESSURE:
        return "molecular solid of a gas, or a high-pressure-only phase"
    if els & NOBLE_GASES:
        return "contains a noble gas"
    if len(els) == 1 and els <= GASEOUS_ELEMENTS:
        return "elemental solid of a gas (molecular crystal, not a lab phase)"
    if els & NO_STABLE_ISOTOPE:
        return "element without stable isotopes"
    if len(els) > MAX_ELEMENTS:
        return f"more than {MAX_ELEMENTS} elements (alloy approximant)"
    if not has_form_factors:
        return "element without X-ray form factors"
    if min_distance < MIN_DISTANCE_A:
        return f"atoms {min_distance:.2f} A apart (unphysical)"
    return None


def _phase_from_structure(s, pid: str, source: str, reference: str, year: int, license_: str,
                          sg_number: int, name: str = "", answer_eligible: bool = True,
                          display_formula: str = "") -> Phase:
    from pymatgen.symmetry.groups import SpaceGroup  # deferred: heavy (pymatgen)
    try:
        sg_symbol = SpaceGroup.from_int_number(sg_number).symbol
    except Exception:
        sg_symbol = str(sg_number)
    mass = float(sum(site.specie.atomic_mass for site in s))
    return Phase(
        id=pid, formula=s.composition.reduced_formula, spacegroup=sg_symbol, sg_number=int(sg_number),
        elements=tuple(sorted({site.specie.symbol for site in s})), year=int(year), source=source,
        reference=reference, license=license_, density=float(s.density), cell_mass=mass,
        volume=float(s.volume), lattice=tuple(tuple(round(float(v), 6) for v in r) for r in s.lattice.matrix),
        species=tuple(site.specie.symbol for site in s),
        frac_coords=tuple(tuple(round(float(v) % 1.0, 6) for v in site.frac_coords) for site in s),
        answer_eligible=answer_eligible, name=name, display_formula=display_formula)


def _min_distance(s) -> float:
    if len(s) < 2:
        # one atom per cell: shortest lattice translation
        return float(min(s.lattice.abc))
    dm = s.distance_matrix + np.eye(len(s)) * 1e9
    return float(min(dm.min(), min(s.lattice.abc)))


def _curated_phases():
    from pymatgen.core import Lattice, Structure  # deferred: heavy (pymatgen)
    for e in CURATED:
        lat = Lattice.from_parameters(*e["lattice"])
        s = Structure.from_spacegroup(e["sg"], lat, [x[0] for x in e["sites"]], [x[1:] for x in e["sites"]])
        yield s, dict(pid=f"cur:{e['key']}", source="curated", reference=e["ref"] +
                      ("" if e["ref_checked"] else " [citation not re-checked offline]"),
                      year=e["year"], license_="Apache-2.0 (entries ours; facts from the cited literature)",
                      sg_number=e["sg_number"], name=e.get("mineral", ""), display_formula=e["formula"])


_YEAR = re.compile(r"year\s*=\s*[\"{]?\s*(\d{4})")
_FIELD = lambda name: re.compile(name + r"\s*=\s*[\"{]\s*(.*?)\s*[\"}]\s*,?\s*\n", re.S)


def _aflow_reference(bib: str) -> tuple[str, int]:
    first = bib.split("@", 2)[1] if "@" in bib else bib   # the structure's own reference (before Mehl2017)
    year_m = _YEAR.search(first)
    year = int(year_m.group(1)) if year_m else 2017
    bits = []
    for key in ("author", "journal", "volume"):
        m = _FIELD(key).search(first)
        if m and m.group(1).strip() not in ("None", "0", ""):
            bits.append(" ".join(m.group(1).split()))
    return (", ".join(bits) + f" ({year})").strip(), year


def _aflow_phases():
    from pymatgen.analysis.prototypes import AFLOW_PROTOTYPE_LIBRARY  # deferred: heavy (pymatgen)
    for entry in AFLOW_PROTOTYPE_LIBRARY:
        snl, tags = entry["snl"], entry["tags"]
        label = tags["aflow"]
        ref, year = _aflow_reference(snl.references or "")
        sg_number = int(label.split("_")[2])
        pid = f"aflow:{label}:{snl.structure.composition.reduced_formula}"
        yield snl.structure, dict(pid=pid, source="aflow", reference=ref, year=year,
                                  license_="MIT (pymatgen); AFLOW prototype library, Mehl et al. 2017",
                                  sg_number=sg_number, name=tags.get("mineral", "") or "")


_ASE_SG = {"fcc": 225, "bcc": 229, "hcp": 194, "diamond": 227}


def _ase_phases():
    # deferred: heavy (ase)
    from ase.build import bulk
    from ase.data import chemical_symbols, reference_states
    from pymatgen.io.ase import AseAtomsAdaptor  # deferred: heavy (pymatgen)
    for z, state in enumerate(reference_states):
        if not state or state.get("symmetry") not in _ASE_SG:
            continue
        sym, kind = chemical_symbols[z], state["symmetry"]
        kw = {"a": state["a"]}
        if kind == "hcp":
            kw["c"] = state["a"] * state.get("c/a", 1.633)
        atoms = bulk(sym, kind, cubic=kind != "hcp", **kw)
        yield AseAtomsAdaptor.get_structure(atoms), dict(
            pid=f"ase:{sym}", source="ase", reference="ase.data.reference_states (Ashcroft & Mermin, 1976)",
            year=1976, license_="LGPL-2.1+ (ase)", sg_number=_ASE_SG[kind], name=f"{sym} ({kind})")


# (prototype phase id, formula pattern, replaced element) -> distractor families
SUBSTITUTION_PROTOTYPES = {
    "rocksalt": ("cur:NiO_bunsenite", "Ni", "{M}O"),
    "rutile": ("cur:TiO2_rutile", "Ti", "{M}O2"),
    "corundum": ("cur:Cr2O3_eskolaite", "Cr", "{M}2O3"),
    "fluorite": ("cur:CeO2_cerianite", "Ce", "{M}O2"),
    "wurtzite": ("cur:ZnO_zincite", "Zn", "{M}O"),
}
SUBSTITUTION_CATIONS = ("Li Mg Al Ca Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge Sr Y Zr Nb Mo In Sn La Ce Bi W").split()


def _substituted(base: list[tuple], existing: set[tuple[str, int]]):
    from pymatgen.core import Element  # deferred: heavy (pymatgen)
    by_id = {kw["pid"]: s for s, kw in base}
    for proto, (pid, old, _pattern) in SUBSTITUTION_PROTOTYPES.items():
        s0 = by_id[pid]
        r_old = Element(old).average_ionic_radius or Element(old).atomic_radius
        r_o = Element("O").average_ionic_radius
        for m in SUBSTITUTION_CATIONS:
            if m == old:
                continue
            s = s0.copy()
            s.replace_species({old: m})
            r_new = Element(m).average_ionic_radius or Element(m).atomic_radius
            s.scale_lattice(s0.volume * (float(r_new + r_o) / float(r_old + r_o)) ** 3)
            key = (s.composition.reduced_formula, _sg_of(pid, base))
            if key in existing:
                continue
            existing.add(key)
            yield s, dict(pid=f"sub:{s.composition.reduced_formula}:{proto}", source="substitution",
                          reference=f"{proto} prototype ({pid}) with {old}->{m}, lattice scaled by ionic radii",
                          year=1900, license_="derived here", sg_number=key[1], name=f"{proto}-type (hypothetical)",
                          answer_eligible=False)


def _sg_of(pid: str, base) -> int:
    for _s, kw in base:
        if kw["pid"] == pid:
            return kw["sg_number"]
    raise KeyError(pid)


def build_library(verbose: bool = False) -> tuple[list[Phase], list[tuple[str, str]]]:
    """All sources -> filtered, de-duplicated phases; also the (id, reason) of what was dropped."""
    warnings.filterwarnings("ignore")
    # deferred: cycle (neon_hpc.envs.xrd.science.simulate imports this module)
    from neon_hpc.envs.xrd.science.simulate import form_factor_table
    known_ff = set(form_factor_table())
    candidates = list(_curated_phases()) + list(_aflow_phases()) + list(_ase_phases())
    phases, dropped, seen, used = [], [], set(), set()
    for s, kw in sorted(candidates, key=lambda c: SOURCE_PRIORITY[c[1]["source"]]):
        els = sorted({site.specie.symbol for site in s})
        if not s.is_ordered:
            dropped.append((kw["pid"], "partially occupied sites"))
            continue
        reason = junk_reason(els, _min_distance(s), set(els) <= known_ff, s.composition.reduced_formula)
        key = (s.composition.reduced_formula, kw["sg_number"])
        if reason is None and key in seen:
            reason = "duplicate of an earlier source (same formula and space group)"
        if reason:
            dropped.append((kw["pid"], reason))
            continue
        seen.add(key)
        kw = dict(kw, pid=_unique_id(kw["pid"], used))
        phases.append(_phase_from_structure(s, **kw))
    curated = [(s, kw) for s, kw in candidates if kw["source"] == "curated"]
    for s, kw in _substituted(curated, seen):
        phases.append(_phase_from_structure(s, **kw))
    return phases, dropped


def _unique_id(pid: str, used: set[str]) -> str:
    """AFLOW labels repeat across parameter sets: suffix -2, -3... in library order (stable)."""
    out, n = pid, 1
    while out in used:
        n += 1
        out = f"{pid}-{n}"
    used.add(out)
    return out


def write_library(path: Path = LIBRARY_JSON) -> dict:
    phases, dropped = build_library()
    payload = {"format": "neon-hpc xrd phase library v1",
               "sources": {"curated": "neon_hpc/envs/xrd/science/curated.py",
                           "aflow": "pymatgen AFLOW_PROTOTYPE_LIBRARY",
                           "ase": "ase.data.reference_states", "substitution": "derived distractors"},
               "dropped": [{"id": i, "reason": r} for i, r in dropped],
               "phases": [p.to_json() for p in phases]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, separators=(",", ":")))
    tmp.replace(path)
    load_library.cache_clear()
    return {"phases": len(phases), "dropped": len(dropped)}


if __name__ == "__main__":
    print(write_library())
