"""Task sets: synthetic powder patterns with dates, chemical systems, conditions and history.

A :class:`Task` is what a rollout worker hands the agent: the measured pattern, what the lab
knows (elements, precursors, synthesis conditions), its date, and -- through the dated records database --
earlier experiments.  Its ``truth`` is for the grader only.

Presets (:data:`PRESETS`): ``tiny`` (6 simple phases, 1-2 per task, 500-point pattern: for
the embedded CPU RL loop), ``easy``, ``medium``, ``realistic`` (2-4 phases down to 4 wt%,
zero shift, strain, small crystallites, texture, amorphous hump, Kalpha2, Poisson noise,
AFLOW oxides in the answer pool).

Splits (:data:`SPLITS`), deterministic from (preset, split, seed, index):

- ``train`` / ``test_id``: same distribution, independent random streams, dates 2016-2023,
  chemical systems outside the held-out set;
- ``test_ood``: only *held-out chemical systems* (a fixed hash of the system string picks
  them), which never occur in train;
- ``test_temporal``: dated 2024-2025, after every train task; the library and history
  visible to a task end at its own date (the records database enforces it).

Each task's own record (with its verified phases) and a follow-up record dated after it go
into the records database too: the date cutoff, not the absence of data, is what keeps the answer away
from the agent.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from neon_hpc.envs.xrd.science.library import Library, load_library
from neon_hpc.envs.xrd.science.records import RecordDB, chemical_system, is_postgres, redact_dsn
from neon_hpc.envs.xrd.science.simulate import (
    Instrument,
    Microstructure,
    background,
    phase_pattern,
    phase_reflections,
    poisson_counts,
)
from neon_hpc.envs.xrd.science.tools import TaskContext
from neon_hpc.util.progress import bar

SPLITS = ("train", "test_id", "test_ood", "test_temporal")
TRAIN_DATES = ("2016-01-01", "2023-12-31")
TEMPORAL_DATES = ("2024-01-01", "2025-12-31")
OOD_MODULUS = 5          # about 1 in 5 chemical systems is held out

TINY_POOL = ("cur:NiO_bunsenite", "cur:ZnO_zincite", "cur:TiO2_rutile", "cur:TiO2_anatase",
             "cur:CeO2_cerianite", "cur:MgO_periclase")


@dataclass(frozen=True)
class Preset:
    name: str
    n_phases: tuple[int, int]
    min_fraction: float
    two_theta: tuple[float, float, float]       # start, stop, step
    ka2: bool
    zero_shift: float                           # max |shift|, deg
    strain: float                               # max |lattice strain|
    size_nm: tuple[float, float]                # (0, 0) = no size broadening
    microstrain: float
    texture_prob: float
    hump_prob: float
    peak_counts: tuple[float, float]
    background_level: float                     # relative to the strongest peak
    aflow_answers: bool
    default_n: int
    give_precursors: bool


PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", (1, 2), 0.2, (20.0, 70.0, 0.1), False, 0.0, 0.0, (0, 0), 0.0, 0.0, 0.0,
                   (2e4, 2e4), 0.02, False, 64, False),
    "easy": Preset("easy", (1, 2), 0.1, (10.0, 80.0, 0.02), True, 0.0, 0.002, (80, 200), 0.0, 0.0, 0.0,
                   (2e4, 5e4), 0.03, False, 50, False),
    "medium": Preset("medium", (2, 3), 0.05, (10.0, 80.0, 0.02), True, 0.05, 0.004, (25, 150), 0.0, 0.0, 0.2,
                     (8e3, 2e4), 0.05, False, 50, True),
    "realistic": Preset("realistic", (2, 4), 0.04, (10.0, 90.0, 0.02), True, 0.1, 0.008, (12, 120), 0.001, 0.3,
                        0.5, (3e3, 1e4), 0.08, True, 50, True),
}


@dataclass
class Pattern:
    two_theta: np.ndarray
    intensity: np.ndarray


@dataclass
class Task:
    id: str
    date: str
    chemical_system: str
    elements: list[str]
    precursors: list[str]
    conditions: dict
    pattern: Pattern
    truth: list[tuple[str, str, float]]         # (phase_id, formula, weight_fraction)
    split: str
    preset: str
    instrument: dict = field(default_factory=dict)   # wavelength, wavelength2, ka2_ratio
    history: list[dict] = field(default_factory=list)  # experiment records for the records database

    def public_view(self) -> dict:
        """What the agent may be told up front (no truth, no pattern arrays): for the prompt."""
        x = self.pattern.two_theta
        return {"task_id": self.id, "date": self.date, "chemical_system": self.chemical_system,
                "elements": list(self.elements), "precursors": list(self.precursors),
                "conditions": dict(self.conditions), "instrument": dict(self.instrument),
                "two_theta_range": [round(float(x[0]), 3), round(float(x[-1]), 3)] if len(x) else [],
                "n_points": int(len(x))}

    def records(self) -> list[dict]:
        """Store records of this task: its history, itself (labelled) and a later follow-up."""
        own = {"sample_id": self.id, "date": self.date, "elements": self.elements, "precursors": self.precursors,
               "conditions": self.conditions, "phases": [{"phase_id": p, "formula": f, "weight_fraction": w}
                                                        for p, f, w in self.truth],
               "source": f"task:{self.preset}", "notes": "the task itself; hidden by the date cutoff"}
        later = dict(own, sample_id=f"{self.id}-followup",
                     date=(_dt.date.fromisoformat(self.date) + _dt.timedelta(days=14)).isoformat(),
                     notes="re-measurement after the task date; must never be visible to it")
        return list(self.history) + [own, later]

    def to_json(self) -> dict:
        return {"id": self.id, "date": self.date, "chemical_system": self.chemical_system,
                "elements": self.elements, "precursors": self.precursors, "conditions": self.conditions,
                "two_theta": [round(float(v), 4) for v in self.pattern.two_theta],
                "intensity": [round(float(v), 2) for v in self.pattern.intensity],
                "truth": [list(t) for t in self.truth], "split": self.split, "preset": self.preset,
                "instrument": self.instrument, "history": self.history}

    @classmethod
    def from_json(cls, d: dict) -> "Task":
        return cls(id=d["id"], date=d["date"], chemical_system=d["chemical_system"], elements=list(d["elements"]),
                   precursors=list(d["precursors"]), conditions=dict(d["conditions"]),
                   pattern=Pattern(np.asarray(d["two_theta"], float), np.asarray(d["intensity"], float)),
                   truth=[(t[0], t[1], float(t[2])) for t in d["truth"]], split=d["split"], preset=d["preset"],
                   instrument=dict(d.get("instrument") or {}), history=list(d.get("history") or []))


def is_held_out(system: str) -> bool:
    """The fixed OOD partition of chemical systems (stable across runs and machines)."""
    return int(hashlib.sha256(system.encode()).hexdigest()[:8], 16) % OOD_MODULUS == 0


POOL_SIMILARITY_MAX = 0.9     # answers whose patterns are this alike are not both in a pool


def answer_pool(preset: Preset, lib: Library) -> list[str]:
    if preset.name == "tiny":
        return list(TINY_POOL)
    return list(_pool(preset.aflow_answers, lib.phases[0].id if lib.phases else ""))


@functools.lru_cache(maxsize=4)
def _pool(aflow_answers: bool, _library_key: str) -> tuple[str, ...]:
    """Curated phases (+ AFLOW oxides), minus near-indistinguishable patterns (e.g. tridymite variants).

    A pattern-level duplicate would make a task ill-posed: the grader tells the space groups
    apart, the data cannot.  The first of each similar group (curated first) is kept.
    """
    lib = load_library()
    pool = [p.id for p in lib.phases if p.source == "curated" and p.answer_eligible]
    if aflow_answers:
        pool += [p.id for p in lib.phases if p.source == "aflow" and "O" in p.elements and len(p.elements) <= 3
                 and len(p.species) <= 40]
    x = np.arange(10.0, 90.0, 0.05)
    inst = Instrument(ka2_ratio=0.0, U=0.0, V=0.0, W=0.04)
    profiles = []
    for pid in pool:
        y = phase_pattern(phase_reflections(pid, 1.0), x, inst)
        profiles.append(y / (np.linalg.norm(y) or 1.0))
    kept: list[int] = []
    for i, prof in enumerate(profiles):
        if all(float(prof @ profiles[j]) < POOL_SIMILARITY_MAX for j in kept):
            kept.append(i)
    return tuple(pool[i] for i in kept)


def _rng(preset: str, split: str, seed: int, index: int) -> np.random.Generator:
    key = hashlib.sha256(f"{preset}/{split}/{seed}/{index}".encode()).digest()
    return np.random.default_rng(int.from_bytes(key[:8], "little"))


def _random_date(rng: np.random.Generator, lo: str, hi: str) -> str:
    a, b = _dt.date.fromisoformat(lo), _dt.date.fromisoformat(hi)
    return (a + _dt.timedelta(days=int(rng.integers(0, (b - a).days + 1)))).isoformat()


def _pick_phases(rng, pool: list[str], preset: Preset, split: str, lib: Library) -> list[str]:
    for _ in range(500):
        k = int(rng.integers(preset.n_phases[0], preset.n_phases[1] + 1))
        ids = [pool[i] for i in rng.choice(len(pool), size=k, replace=False)]
        keys = {(lib.get(p).formula, lib.get(p).sg_number) for p in ids}
        if len(keys) < k:
            continue
        held = is_held_out(chemical_system(e for p in ids for e in lib.get(p).elements))
        if held == (split == "test_ood"):
            return ids
    raise RuntimeError(f"could not draw phases for split {split!r} from a pool of {len(pool)}")


def _fractions(rng, k: int, min_fraction: float) -> np.ndarray:
    if k == 1:
        return np.ones(1)
    for _ in range(1000):
        w = rng.dirichlet(np.ones(k))
        if w.min() >= min_fraction:
            return np.round(w / w.sum(), 4)
    return np.full(k, 1.0 / k)


def _synthesize(rng, ids: list[str], wf: np.ndarray, preset: Preset, lib: Library):
    lo, hi, step = preset.two_theta
    x = np.round(np.arange(lo, hi + step / 2, step), 6)
    inst = Instrument(ka2_ratio=0.5 if preset.ka2 else 0.0,
                      zero_shift=float(rng.uniform(-preset.zero_shift, preset.zero_shift)),
                      W=float(rng.uniform(0.002, 0.004)) if preset.name != "tiny" else 0.01)
    dens = np.array([lib.get(p).density for p in ids])
    vol = (wf / dens) / np.sum(wf / dens)
    d_min = round(inst.wavelength2 / (2 * np.sin(np.radians(min(hi + 3, 179.0) / 2))) * 0.97, 3)
    y = np.zeros_like(x)
    micro_used = []
    for p, v in zip(ids, vol):
        micro = Microstructure(
            strain=float(rng.uniform(-preset.strain, preset.strain)),
            size_nm=float(rng.uniform(*preset.size_nm)) if preset.size_nm[1] else 0.0,
            microstrain=float(rng.uniform(0, preset.microstrain)),
            texture_r=float(rng.uniform(0.7, 1.3)) if rng.random() < preset.texture_prob else 1.0,
            texture_hkl=tuple(int(v) for v in rng.integers(0, 2, size=3)) or (0, 0, 1))
        if micro.texture_hkl == (0, 0, 0):
            micro = Microstructure(**{**micro.__dict__, "texture_hkl": (0, 0, 1)})
        y += v * phase_pattern(phase_reflections(p, d_min), x, inst, micro)
        micro_used.append(micro.__dict__)
    y = y / y.max()
    bg = background(x, coeffs=(1.0, float(rng.uniform(-0.4, 0.0)), float(rng.uniform(0, 0.2))),
                    hump_height=float(rng.uniform(0.5, 1.5)) if rng.random() < preset.hump_prob else 0.0)
    y = y + preset.background_level * bg / max(bg.max(), 1e-9)
    counts = poisson_counts(y, float(rng.uniform(*preset.peak_counts)), rng)
    return x, counts, inst, micro_used


def _history(rng, task_id: str, date: str, ids: list[str], lib: Library, system: str) -> list[dict]:
    out = []
    for k in range(int(rng.integers(0, 4))):
        days = int(rng.integers(7, 700))
        subset = [ids[i] for i in sorted(rng.choice(len(ids), size=int(rng.integers(1, len(ids) + 1)),
                                                    replace=False))]
        w = _fractions(rng, len(subset), 0.05)
        els = sorted({e for p in subset for e in lib.get(p).elements})
        out.append({"sample_id": f"{task_id}-h{k}",
                    "date": (_dt.date.fromisoformat(date) - _dt.timedelta(days=days)).isoformat(),
                    "elements": els, "precursors": [lib.get(p).display_formula or lib.get(p).formula for p in subset],
                    "conditions": {"temperature_C": int(rng.choice([25, 300, 500, 700, 900])), "time_min": 60,
                                   "atmosphere": "air"},
                    "phases": [{"phase_id": p, "formula": lib.get(p).display_formula or lib.get(p).formula,
                                "weight_fraction": float(x)} for p, x in zip(subset, w)],
                    "source": "synthetic:history", "notes": f"earlier experiment in {system}"})
    return out


def make_task(preset_name: str, split: str, seed: int, index: int, library: Library | None = None) -> Task:
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    lib = library or load_library()
    preset = PRESETS[preset_name]
    rng = _rng(preset_name, split, seed, index)
    ids = _pick_phases(rng, answer_pool(preset, lib), preset, split, lib)
    wf = _fractions(rng, len(ids), preset.min_fraction)
    date = _random_date(rng, *(TEMPORAL_DATES if split == "test_temporal" else TRAIN_DATES))
    x, y, inst, micro = _synthesize(rng, ids, wf, preset, lib)
    elements = sorted({e for p in ids for e in lib.get(p).elements})
    system = chemical_system(elements)
    task_id = f"{preset_name}-{split}-s{seed}-{index:05d}"
    precursors = []
    if preset.give_precursors:
        precursors = [lib.get(p).display_formula or lib.get(p).formula for p in ids]
        rng.shuffle(precursors)
    truth = [(p, lib.get(p).display_formula or lib.get(p).formula, float(w)) for p, w in zip(ids, wf)]
    conditions = {"temperature_C": 25, "time_min": 0, "atmosphere": "air",
                  "procedure": "weighed powder mixture, ground in a mortar"}
    return Task(id=task_id, date=date, chemical_system=system, elements=elements, precursors=precursors,
                conditions=conditions, pattern=Pattern(x, y), truth=truth, split=split, preset=preset_name,
                instrument={"wavelength": inst.wavelength, "wavelength2": inst.wavelength2,
                            "ka2_ratio": inst.ka2_ratio},
                history=_history(rng, task_id, date, ids, lib, system))


def load_tasks(preset: str, split: str, seed: int = 0, n: int | None = None) -> list[Task]:
    """Deterministic task list: the same (preset, split, seed) always gives the same tasks."""
    count = PRESETS[preset].default_n if (n is None and preset in PRESETS) else n
    if count is None:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    lib = load_library()
    return [make_task(preset, split, seed, i, lib)
            for i in bar(range(int(count)), desc=f"tasks {preset}/{split}", unit="task")]


# ----------------------------------------------------------------------------------------------
# files the rollout workers read, and the records database the tools query

DB_POINTER = "record_db.json"   # a task folder whose experiments live in a server: {"db": DSN}
OLD_DB_POINTER = "store.json"   # its name before the records database was named RecordDB: refused, naming the fix


def write_tasks(tasks: list[Task], out_dir: str | Path, include_real: bool = True, db: str | None = None) -> dict:
    """``tasks.jsonl`` (one task per line) + the records database (library, histories, real data).

    The records database is ``experiments.sqlite`` in the folder, or, with ``db`` a ``postgresql://`` DSN,
    that database (upserts: rerunning is safe), recorded in ``record_db.json`` without its password
    (libpq takes it from PGPASSWORD or ~/.pgpass).  Each file is published by rename, the
    folder's pointer to the records database last.
    """
    # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
    from neon_hpc.protocol.rundir import atomic_write_json, atomic_write_text
    if db is not None and not is_postgres(db):
        raise ValueError(f"--db {db!r}: expected a postgresql:// DSN (without --db the records database is "
                         f"experiments.sqlite inside the task folder)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if db is None:
        db_tmp = out / "experiments.sqlite.tmp"
        db_tmp.unlink(missing_ok=True)
        record_db = build_record_db(tasks, db_tmp, include_real=include_real)
        n_exp = record_db.count("experiments")
        record_db.close()
        db_tmp.replace(out / "experiments.sqlite")
    else:
        record_db = build_record_db(tasks, db, include_real=include_real)
        n_exp = record_db.count("experiments")
        record_db.close()
    atomic_write_text(out / "tasks.jsonl", "".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    if db is not None:
        atomic_write_json(out / DB_POINTER, {"db": redact_dsn(db)})
    return {"tasks": len(tasks), "experiments": n_exp, "dir": str(out),
            "record_db": redact_dsn(db) if db else str(out / "experiments.sqlite")}


def read_tasks(path: str | Path) -> list[Task]:
    p = Path(path)
    if p.is_dir():
        p = p / "tasks.jsonl"
    tasks = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(Task.from_json(json.loads(line)))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{p}:{lineno}: not a task record ({e})") from None
    return tasks


def open_task_set(path: str | Path) -> tuple[list[Task], RecordDB]:
    """A folder written by :func:`write_tasks`: its tasks and its records database
    (for ``make_context(task, record_db)``)."""
    folder = Path(path)
    pointer, db = folder / DB_POINTER, folder / "experiments.sqlite"
    if pointer.exists():
        return read_tasks(folder), RecordDB.open(json.loads(pointer.read_text())["db"])
    old = folder / OLD_DB_POINTER
    if old.exists():
        raise FileNotFoundError(f"{old}: the records database pointer's old name; rename it "
                                f"`mv {old} {pointer}` (same content), or rewrite the task set with "
                                f"`neon-hpc xrd tasks ... --out {folder} --db postgresql://...`")
    if not db.exists():
        raise FileNotFoundError(f"{db}: missing (and no {DB_POINTER} naming a database); write the task set "
                                f"with `neon-hpc xrd tasks ... --out {folder} [--db postgresql://...]`")
    return read_tasks(folder), RecordDB.open(db)


def build_record_db(tasks: list[Task] = (), path: str | Path = ":memory:", include_real: bool = True,
                    library: Library | None = None) -> RecordDB:
    record_db = RecordDB.open(path)
    record_db.add_phases((library or load_library()).phases)
    records = [r for t in tasks for r in t.records()]
    if include_real:
        # deferred: cycle (neon_hpc.envs.xrd.science.real imports this module)
        from neon_hpc.envs.xrd.science.real import real_records
        records += real_records()
    record_db.add_experiments(records)
    return record_db


_shared: dict = {}
_shared_lock = threading.Lock()


def shared_record_db() -> RecordDB:
    """A process-wide in-memory records database with the library and the real data (tasks added on use)."""
    with _shared_lock:
        if "record_db" not in _shared:
            _shared["record_db"] = build_record_db([], ":memory:", include_real=True)
        return _shared["record_db"]


def make_context(task: Task, record_db: RecordDB | None = None):
    """The :class:`~neon_hpc.envs.xrd.science.tools.TaskContext` of a task (its records are added to the
    records database)."""
    if record_db is None:
        record_db = shared_record_db()
        with _shared_lock:
            record_db.add_experiments(task.records())
    return TaskContext.for_task(task, record_db)
