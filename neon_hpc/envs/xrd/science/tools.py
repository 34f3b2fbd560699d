"""The agent's tools: pure functions with JSON schemas, called through :func:`call_tool`.

``call_tool(name, args, ctx)`` never raises: an unknown tool, arguments that do not match the
schema, an unknown or not-yet-published phase, or an internal failure all come back as
``{"error": "<readable message>"}`` so that one bad call never ends an episode.

Every library or history look-up goes through ``ctx.view`` (:class:`~neon_hpc.envs.xrd.science.records.DatedView`),
which returns nothing dated on or after the task's date.  Outputs are small (peak lists,
fractions, a down-sampled pattern) because they go into an LLM context.

Toolsets: ``full`` (every text tool), ``minimal`` (raw pattern access + simulation only) and
``analyst`` (full + ``plot_fit``, which writes PNGs into ``TaskContext.plot_dir``).
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jsonschema
import numpy as np

from neon_hpc.envs.xrd.science.fitting import DETECTION_Z_MIN, Fitter, detection_stats
from neon_hpc.envs.xrd.science.library import ELEMENT_SYMBOLS, Library, load_library, normalize_formula
from neon_hpc.envs.xrd.science.plot import plot_fit
from neon_hpc.envs.xrd.science.quant import default_model, quantify, report
from neon_hpc.envs.xrd.science.records import DatedView, RecordDB
from neon_hpc.envs.xrd.science.simulate import Instrument, lorentz_polarization, phase_reflections, two_theta_of
from neon_hpc.util.bounded import MESSAGE_CAP, clip_text, short_repr

MAX_FIT_PHASES = 6
# what one call may carry, checked before its arguments are validated: a million-key object
# or a 10 MB value must come back as a short error, not be walked or echoed whole
MAX_ARGUMENTS = 32
MAX_ARGUMENT_CHARS = 16384


@dataclass
class TaskContext:
    """What a tool may see of a task: its pattern, its date cutoff and the records database."""
    two_theta: np.ndarray
    intensity: np.ndarray
    cutoff: str
    db: RecordDB
    elements: list[str] = field(default_factory=list)
    precursors: list[str] = field(default_factory=list)   # what the lab weighed in (formulas), when stated
    instrument: Instrument = field(default_factory=Instrument)
    library: Library = field(default_factory=load_library)
    task_id: str = ""
    cache: dict = field(default_factory=dict)
    plot_dir: str = ""               # where plot_fit writes PNGs; "" = plotting refused
    detection_z_min: float | None = None   # fit_phases' significance threshold; None = fitting.DETECTION_Z_MIN
                                           # (an evaluation protocol sets one fitted on other data)
    quant: object | None = None      # quant.QuantModel (microabsorption radius, s.e. model term);
                                     # None = quant.default_model(instrument)

    @property
    def view(self) -> DatedView:
        v = self.cache.get("_view")
        if v is None:
            v = self.cache["_view"] = self.db.view(self.cutoff)
        return v

    @classmethod
    def for_task(cls, task, record_db: RecordDB) -> "TaskContext":
        inst = Instrument(wavelength=task.instrument.get("wavelength", Instrument.wavelength),
                          wavelength2=task.instrument.get("wavelength2", Instrument.wavelength2),
                          ka2_ratio=task.instrument.get("ka2_ratio", Instrument.ka2_ratio),
                          measured=bool(task.instrument.get("measured", False)))
        return cls(two_theta=np.asarray(task.pattern.two_theta, float),
                   intensity=np.asarray(task.pattern.intensity, float), cutoff=task.date, db=record_db,
                   elements=list(task.elements), precursors=list(getattr(task, "precursors", []) or []),
                   instrument=inst, task_id=task.id)

    def fitter(self):
        f = self.cache.get("_fitter")
        if f is None:
            f = self.cache["_fitter"] = Fitter(self.two_theta, self.intensity, self.instrument, self.library)
        return f


class ToolError(ValueError):
    """A readable problem with a tool call (becomes {"error": ...})."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict                     # JSON schema of the arguments object
    function: Callable[[dict, TaskContext], dict]

    def openai_schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


# ----------------------------------------------------------------------------------------------
# argument validation: JSON Schema (draft 2020-12) by the jsonschema package; what comes back
# is one readable message naming the argument and what it allows, bounded like every echo

def _finite_number(checker, value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (not isinstance(value, float) or math.isfinite(value)))


def _finite_integer(checker, value) -> bool:
    return _finite_number(checker, value) and (isinstance(value, int) or value.is_integer())


# NaN passes every minimum/maximum comparison, so "number" and "integer" mean finite here
_ArgValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"number": _finite_number, "integer": _finite_integer}))
_VALIDATORS: dict[int, tuple[dict, Any]] = {}      # id(schema) -> (schema, validator); schemas are module constants
# which error of several to report: a missing or unknown argument first, then a wrong type
_RANK = {"required": 0, "additionalProperties": 1, "type": 2}
_MAX_ERRORS = 64                                   # errors looked at before picking one


def _validator(schema: dict):
    hit = _VALIDATORS.get(id(schema))
    if hit is None or hit[0] is not schema:
        _ArgValidator.check_schema(schema)         # a broken tool schema is a bug, refused loudly
        hit = _VALIDATORS[id(schema)] = (schema, _ArgValidator(schema))
    return hit[1]


def _where(path, root: str) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or root


def _describe(e, where: str) -> str:
    """One jsonschema error as 'ARG: what is wrong; what is allowed'."""
    kw, allowed, value = e.validator, e.validator_value, e.instance
    if kw == "type":
        if isinstance(value, float) and not math.isfinite(value):
            return f"{where}: must be a finite number"
        want = " or ".join(allowed) if isinstance(allowed, list) else allowed
        return f"{where}: expected {want}, got {type(value).__name__} {short_repr(value, 80)}"
    if kw == "required":
        missing = [k for k in allowed if k not in value]
        return f"{where}: missing required argument(s) {', '.join(missing)}"
    if kw == "additionalProperties":
        known = list(e.schema.get("properties", {}))
        extra = [k for k in value if k not in known]
        named = ", ".join(clip_text(str(k), 60) for k in extra[:8]) + (f" and {len(extra) - 8} more"
                                                                  if len(extra) > 8 else "")
        what = "argument(s)" if not e.absolute_path else "key(s)"
        return f"{where}: unknown {what} {named}; valid: {', '.join(known) or 'none'}"
    bounds = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
    if kw in bounds:
        return f"{where}: must be {bounds[kw]} {allowed}, got {short_repr(value, 80)}"
    if kw == "enum":
        return f"{where}: must be one of {short_repr(allowed)}, got {short_repr(value, 80)}"
    if kw == "const":
        return f"{where}: must be {short_repr(allowed, 80)}, got {short_repr(value, 80)}"
    if kw == "maxLength":
        return f"{where}: string too long (max {allowed} characters)"
    if kw == "minLength":
        return f"{where}: needs at least {allowed} character(s)"
    if kw == "pattern":
        return f"{where}: must match {short_repr(allowed, 80)}, got {short_repr(value, 80)}"
    if kw == "minItems":
        return f"{where}: needs at least {allowed} item(s)"
    if kw == "maxItems":
        return f"{where}: at most {allowed} items, got {len(value)}"
    if kw == "uniqueItems":
        return f"{where}: items must be unique"
    return f"{where}: {clip_text(e.message, 300)}"      # other keywords: jsonschema's own words


def validate_args(schema: dict, value: Any, where: str = "arguments") -> None:
    """Raise :class:`ToolError` naming the first problem of ``value`` against ``schema``
    (missing/unknown arguments before types, shallow before deep)."""
    errors = list(itertools.islice(_validator(schema).iter_errors(value), _MAX_ERRORS))
    if errors:
        e = min(errors, key=lambda e: (len(e.absolute_path), _RANK.get(e.validator, 3)))
        raise ToolError(_describe(e, _where(e.absolute_path, where)))


def _obj(properties: dict, required: list[str] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


# ----------------------------------------------------------------------------------------------
# helpers

def _resolve_phase(ref: str, ctx: TaskContext) -> str:
    """A phase id visible at the task's date, from an id or a formula (+ optional space group)."""
    ref = ref.strip()
    if ref in ctx.library:
        if not ctx.view.phase_visible(ref):
            raise ToolError(f"phase {ref!r} is not available before {ctx.cutoff}")
        return ref
    parts = ref.replace(":", " ").split()
    try:
        formula = normalize_formula(parts[0])
    except ValueError:
        raise ToolError(f"unknown phase {ref!r}: give an id from search_phases or a formula like 'TiO2'") from None
    rows = ctx.view.phases(formula=parts[0], limit=50)
    if len(parts) > 1:
        sg = parts[1]
        rows = [r for r in rows if r["spacegroup"].replace(" ", "") == sg or str(r["sg_number"]) == sg]
    if not rows:
        raise ToolError(f"no phase with formula {parts[0]} ({formula}) available before {ctx.cutoff}")
    eligible = [r for r in rows if r["answer_eligible"]] or rows
    if len({(r["formula"], r["sg_number"]) for r in eligible}) > 1:
        opts = ", ".join(f"{r['id']} ({r['spacegroup']})" for r in eligible[:8])
        raise ToolError(f"{parts[0]} has several polymorphs; pick one: {opts}")
    return eligible[0]["id"]


def _d_min(ctx: TaskContext) -> float:
    hi = float(np.max(ctx.two_theta)) if len(ctx.two_theta) else 90.0
    return round(ctx.instrument.wavelength2 / (2 * math.sin(math.radians(min(hi + 3, 179.0) / 2))) * 0.97, 3)


def _sticks(pid: str, ctx: TaskContext, strain: float = 0.0, lo: float | None = None, hi: float | None = None):
    refl = phase_reflections(pid, _d_min(ctx))
    d, f2 = refl.merged()
    tt = two_theta_of(d * (1 + strain), ctx.instrument.wavelength)
    lo = float(ctx.two_theta[0]) if lo is None else lo
    hi = float(ctx.two_theta[-1]) if hi is None else hi
    ok = np.isfinite(tt) & (tt >= lo) & (tt <= hi)
    inten = f2[ok] * lorentz_polarization(tt[ok])
    tt, dd = tt[ok], d[ok] * (1 + strain)
    if len(inten) == 0:
        return tt, inten, dd
    return tt, 100.0 * inten / inten.max(), dd


def _top_peaks(pid: str, ctx: TaskContext, n: int = 5, strain: float = 0.0) -> list[list[float]]:
    tt, inten, _ = _sticks(pid, ctx, strain)
    order = np.argsort(-inten)[:n]
    return [[round(float(tt[i]), 3), round(float(inten[i]), 1)] for i in sorted(order, key=lambda i: tt[i])]


def observed_peaks(x: np.ndarray, y: np.ndarray, min_rel: float = 0.02, max_peaks: int = 50):
    """Peaks of a measured pattern above a rolling-minimum background: (2theta, rel. height %, fwhm)."""
    # deferred: heavy (scipy: importing the tools does not load it)
    from scipy.ndimage import minimum_filter1d, uniform_filter1d
    from scipy.signal import find_peaks, peak_widths
    step = float(np.median(np.diff(x)))
    win = max(3, int(round(2.0 / step)))
    bg = uniform_filter1d(minimum_filter1d(y, win, mode="nearest"), win, mode="nearest")
    net = uniform_filter1d(y - bg, max(1, int(round(0.03 / step))), mode="nearest")
    top = float(net.max()) or 1.0
    noise = float(np.median(np.abs(np.diff(y)))) + 1e-9
    idx, props = find_peaks(net, height=max(min_rel * top, 3 * noise), prominence=max(min_rel * top, 3 * noise) * 0.5,
                            distance=max(1, int(round(0.05 / step))))
    if len(idx) == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    widths = peak_widths(net, idx, rel_height=0.5)[0] * step
    order = np.argsort(-net[idx])[:max_peaks]
    idx, widths = idx[order], widths[order]
    srt = np.argsort(x[idx])
    return x[idx][srt], (100 * net[idx] / top)[srt], widths[srt]


# ----------------------------------------------------------------------------------------------
# the tools

def tool_get_pattern(args: dict, ctx: TaskContext) -> dict:
    x, y = ctx.two_theta, ctx.intensity
    lo = float(args.get("two_theta_min", x[0]))
    hi = float(args.get("two_theta_max", x[-1]))
    if hi <= lo:
        raise ToolError(f"two_theta_max ({hi}) must be greater than two_theta_min ({lo})")
    sel = (x >= lo) & (x <= hi)
    if not np.any(sel):
        raise ToolError(f"no data between {lo} and {hi} deg; the pattern covers {x[0]:.2f}-{x[-1]:.2f}")
    xs, ys = x[sel], y[sel]
    n = int(args.get("max_points", 200))
    bins = np.array_split(np.arange(len(xs)), min(n, len(xs)))
    pts = [[round(float(xs[b[np.argmax(ys[b])]]), 3), round(float(ys[b].max()), 1)] for b in bins if len(b)]
    return {"two_theta_range": [round(float(x[0]), 3), round(float(x[-1]), 3)],
            "step": round(float(np.median(np.diff(x))), 5), "n_points": int(len(x)),
            "max_intensity": round(float(y.max()), 1),
            "wavelength": ctx.instrument.wavelength, "ka2_ratio": ctx.instrument.ka2_ratio,
            "points": pts, "note": "points are bin maxima (two_theta, counts) so peaks survive down-sampling"}


def tool_find_peaks(args: dict, ctx: TaskContext) -> dict:
    xs, h, w = observed_peaks(ctx.two_theta, ctx.intensity, float(args.get("min_relative_height", 0.02)),
                              int(args.get("max_peaks", 30)))
    lam = ctx.instrument.wavelength
    peaks = [{"two_theta": round(float(a), 3), "rel_height": round(float(b), 1), "fwhm": round(float(c), 3),
              "d": round(lam / (2 * math.sin(math.radians(a / 2))), 4)} for a, b, c in zip(xs, h, w)]
    out = {"peaks": peaks, "count": int(len(xs))}
    last = _last_fit(ctx)
    if last is not None and last[1].details.get("components"):
        ids, res = last
        comps = np.asarray(res.details["components"])
        for pk in peaks:
            i = int(np.argmin(np.abs(ctx.two_theta - pk["two_theta"])))
            net_obs = float(ctx.intensity[i] - res.background[i]) or 1.0
            k = int(np.argmax(comps[:, i]))
            pk["explained_by"] = ids[k] if comps[k, i] > 0.1 * abs(net_obs) else None
            pk["calc_over_obs"] = round(float(comps[:, i].sum()) / net_obs, 2)
        out["last_fit"] = {"phases": ids, "rwp": round(res.rwp, 4), "gof": round(res.gof, 3)}
    return out


def tool_search_phases(args: dict, ctx: TaskContext) -> dict:
    if not any(k in args for k in ("elements", "chemical_system", "formula")):
        raise ToolError("give elements (e.g. [\"Ti\", \"O\"]), chemical_system (\"O-Ti\") or formula (\"TiO2\")")
    elements = args.get("elements")
    if elements is not None:
        bad = [e for e in elements if e not in ELEMENT_SYMBOLS]
        if bad:
            raise ToolError(f"unknown element symbol(s): {', '.join(bad)}")
    system = args.get("chemical_system")
    if system is not None:
        bad = [e for e in system.split("-") if e not in ELEMENT_SYMBOLS]
        if bad:
            raise ToolError(f"chemical_system {system!r}: unknown element(s) {', '.join(bad)}; write e.g. 'O-Ti'")
    if args.get("formula") is not None:
        try:
            normalize_formula(args["formula"])
        except ValueError as e:
            raise ToolError(str(e)) from None
    rows = ctx.view.phases(elements=elements, chemical_system_=system, formula=args.get("formula"),
                           limit=int(args.get("limit", 20)))
    if not args.get("include_hypothetical", False):
        rows = [r for r in rows if r["answer_eligible"]]
    out = []
    for r in rows:
        out.append({"id": r["id"], "formula": r["formula"], "spacegroup": r["spacegroup"], "year": r["year"],
                    "source": r["source"], "strongest_peaks": _top_peaks(r["id"], ctx)})
    return {"phases": out, "count": len(out), "visible_before": ctx.cutoff}


def _last_fit(ctx: TaskContext):
    return ctx.cache.get("_last_fit")


def tool_simulate_phase(args: dict, ctx: TaskContext) -> dict:
    pid = _resolve_phase(args["phase"], ctx)
    last = _last_fit(ctx)
    refined = next((p for p in last[1].phases if p.phase_id == pid), None) if last else None
    strain = float(args.get("strain", refined.strain if refined is not None else 0.0))
    lo = float(args.get("two_theta_min", ctx.two_theta[0]))
    hi = float(args.get("two_theta_max", ctx.two_theta[-1]))
    if hi <= lo:
        raise ToolError(f"two_theta_max ({hi}) must be greater than two_theta_min ({lo})")
    tt, inten, d = _sticks(pid, ctx, strain, lo, hi)
    order = np.argsort(-inten)[: int(args.get("max_peaks", 20))]
    order = sorted(order, key=lambda i: tt[i])
    p = ctx.library.get(pid)
    out = {"phase": pid, "formula": p.display_formula or p.formula, "spacegroup": p.spacegroup,
           "lattice": [round(v, 4) for v in p.lattice_params[:3]] + [round(v, 2) for v in p.lattice_params[3:]],
           "wavelength": ctx.instrument.wavelength, "strain": round(strain, 5),
           "peaks": [{"two_theta": round(float(tt[i]), 3), "rel_intensity": round(float(inten[i]), 1),
                      "d": round(float(d[i]), 4)} for i in order]}
    if refined is not None:
        out["refined_in_last_fit"] = {"rwp": round(last[1].rwp, 4),
                                      "weight_fraction": round(refined.weight_fraction, 4),
                                      "lattice": ([round(v, 4) for v in refined.lattice[:3]]
                                                  if refined.lattice else None),
                                      "strain": round(refined.strain, 5),
                                      "note": "peaks above are at the refined strain unless 'strain' is given"}
    return out


def _fit(ids: list[str], ctx: TaskContext, refine: bool = True):
    if len(set(ids)) != len(ids):
        raise ToolError("the same phase is listed twice")
    return refit(ctx, ids, refine)


def refit(ctx: TaskContext, ids: list[str], refine: bool = True):
    """Fit ``ids`` and remember it as the task's last fit (also how a journalled episode's state
    comes back: the fit is deterministic)."""
    res = ctx.fitter().fit(ids, refine=refine, passes=1 if refine else 0)
    ctx.cache["_last_fit"] = (list(ids), res)
    ctx.cache["_last_fit_args"] = (list(ids), bool(refine))
    return res


def _fit_report(res, ctx: TaskContext, z_min: float) -> dict:
    """The fit as the agent reads it: quality, refined parameters, what is (not) detectable, fractions +- s.e."""
    detection_stats(ctx.fitter(), res, z_min)
    out = res.summary()
    detected = [p for p in res.phases if p.significance >= z_min] if res.refined else list(res.phases)
    model = ctx.quant or default_model(ctx.instrument)
    qs = {q.phase_id: q for q in quantify(res, ctx.library, ctx.instrument.wavelength, model)}
    total = sum(qs[p.phase_id].weight_fraction for p in detected) or 1.0
    for row, p in zip(out["phases"], res.phases):
        q = qs[p.phase_id]
        if p in detected:
            row["status"] = "detected"
            row["weight_fraction"] = round(q.weight_fraction / total, 4)
            row["wf_se"] = round(q.se / total, 4)
            row["wf_uncorrected"] = round(q.uncorrected, 4)
            row["microabsorption_moved"] = round(q.moved, 4)
        else:
            row["status"] = "not detectable"
            row["weight_fraction"] = None
            row["below_wt_fraction"] = round(max(p.detection_limit, p.weight_fraction), 4)
        if res.refined:
            row["rwp_without"] = round(p.rwp_without, 4)
    out["quantification"] = report(list(qs.values()), model)
    return out


def tool_fit_phases(args: dict, ctx: TaskContext) -> dict:
    ids = [_resolve_phase(p, ctx) for p in args["phases"]]
    res = _fit(ids, ctx, bool(args.get("refine", True)))
    resid = ctx.intensity - res.calc
    xs, h, _ = observed_peaks(ctx.two_theta, np.clip(resid, 0, None) + res.background, 0.05, 8)
    z_min = DETECTION_Z_MIN if ctx.detection_z_min is None else float(ctx.detection_z_min)
    out = {"detection_z_min": z_min, **_fit_report(res, ctx, z_min)}   # first: tool results may be clipped
    out["unexplained_peaks"] = [[round(float(a), 3), round(float(b), 1)] for a, b in zip(xs, h)]
    out["note"] = ("Rietveld fit; weight_fraction (microabsorption-corrected) +- wf_se (standard error: refinement "
                   "esd + model error; +-2 wf_se is the ~95% interval), wf_esd = refinement-only esd; gof~1 = fit "
                   "at the noise; 'not detectable' = refined scale under detection_z_min esds")
    return out


def tool_compare_hypotheses(args: dict, ctx: TaskContext) -> dict:
    res = {}
    for key in ("a", "b"):
        ids = [_resolve_phase(p, ctx) for p in args[key]]
        r = _fit(ids, ctx, refine=True)
        res[key] = {"phases": ids, "rwp": round(r.rwp, 4), "gof": round(r.gof, 3),
                    "weight_fractions": {p.phase_id: round(p.weight_fraction, 4) for p in r.phases}}
    better = "a" if res["a"]["rwp"] <= res["b"]["rwp"] else "b"
    return {**res, "better": better, "rwp_ratio": round(res["b"]["rwp"] / max(res["a"]["rwp"], 1e-9), 4),
            "note": "fewer phases at a similar rwp is the more likely answer"}


def tool_plot_fit(args: dict, ctx: TaskContext) -> dict:
    """Observed, calculated and difference curves of a fit as a PNG in ``ctx.plot_dir``."""
    if not ctx.plot_dir:
        raise ToolError("plotting is off for this task (no plot directory configured)")
    if args.get("phases"):
        ids = [_resolve_phase(p, ctx) for p in args["phases"]]
        res = _fit(ids, ctx, True)
    else:
        last = _last_fit(ctx)
        if last is None:
            raise ToolError("nothing fitted yet: give phases, or call fit_phases first")
        ids, res = last
    n = ctx.cache["_plots"] = ctx.cache.get("_plots", 0) + 1
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", ctx.task_id or "task")[:80]
    path = Path(ctx.plot_dir) / f"{stem}-fit{n}.png"
    plot_fit(ctx.two_theta, ctx.intensity, res, path, title=f"{ctx.task_id}: {', '.join(ids)}")
    return {"path": str(path), "rwp": round(res.rwp, 4), "gof": round(res.gof, 3),
            "phases": [p.phase_id for p in res.phases]}


def tool_search_history(args: dict, ctx: TaskContext) -> dict:
    elements = args.get("elements") or None
    rows = ctx.view.experiments(elements=None, chemical_system_=args.get("chemical_system"),
                                any_element=elements, limit=int(args.get("limit", 10)))
    out = [{"sample_id": r["sample_id"], "date": r["date"], "chemical_system": r["chemical_system"],
            "precursors": r["precursors"], "conditions": r["conditions"], "phases": r["phases"],
            "has_pattern": r["has_pattern"]} for r in rows]
    return {"experiments": out, "count": len(out), "visible_before": ctx.cutoff}


_PHASE_REF = {"type": "string", "maxLength": 80,
              "description": "a phase id from search_phases, or a formula "
                             "(optionally with space group: 'TiO2 P4_2/mnm')"}
_RANGE = {"two_theta_min": {"type": "number", "minimum": 0, "maximum": 180},
          "two_theta_max": {"type": "number", "minimum": 0, "maximum": 180}}

TOOLS: dict[str, ToolSpec] = {t.name: t for t in [
    ToolSpec("get_pattern", "The measured powder pattern, down-sampled (bin maxima), optionally a 2theta window.",
             _obj({**_RANGE, "max_points": {"type": "integer", "minimum": 10, "maximum": 1000}}), tool_get_pattern),
    ToolSpec("find_peaks", "Peaks of the measured pattern: 2theta, relative height (%), FWHM and d-spacing.",
             _obj({"min_relative_height": {"type": "number", "minimum": 0.001, "maximum": 1.0},
                   "max_peaks": {"type": "integer", "minimum": 1, "maximum": 100}}), tool_find_peaks),
    ToolSpec("search_phases", "Known crystalline phases made of the given elements (any subset), of an exact "
             "chemical system, or of a formula; only phases published before the task's date.",
             _obj({"elements": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1,
                                "maxItems": 12},
                   "chemical_system": {"type": "string", "maxLength": 60},
                   "formula": {"type": "string", "maxLength": 40},
                   "include_hypothetical": {"type": "boolean"},
                   "limit": {"type": "integer", "minimum": 1, "maximum": 100}}), tool_search_phases),
    ToolSpec("simulate_phase", "Simulated peak list (2theta, relative intensity, d) of one phase at the task's "
             "wavelength, optionally with a lattice strain.",
             _obj({"phase": _PHASE_REF, "strain": {"type": "number", "minimum": -0.05, "maximum": 0.05},
                   **_RANGE, "max_peaks": {"type": "integer", "minimum": 1, "maximum": 200}}, ["phase"]),
             tool_simulate_phase),
    ToolSpec("fit_phases", "Whole-pattern refinement of a set of phases (scales, background, zero shift, per-phase "
             "lattice parameters, crystallite size, microstrain, preferred orientation): weight fractions with "
             "esd, Rwp/Rexp/GoF, which phases are detectable, and peaks left unexplained.",
             _obj({"phases": {"type": "array", "items": _PHASE_REF, "minItems": 1, "maxItems": MAX_FIT_PHASES},
                   "refine": {"type": "boolean"}}, ["phases"]), tool_fit_phases),
    ToolSpec("compare_hypotheses", "Fit two phase sets and say which explains the pattern better (Rwp).",
             _obj({"a": {"type": "array", "items": _PHASE_REF, "minItems": 1, "maxItems": MAX_FIT_PHASES},
                   "b": {"type": "array", "items": _PHASE_REF, "minItems": 1, "maxItems": MAX_FIT_PHASES}},
                  ["a", "b"]), tool_compare_hypotheses),
    ToolSpec("plot_fit", "Write the observed, calculated and difference curves of a fit (the given phases, or the "
             "last fit) to a PNG file; returns its path.",
             _obj({"phases": {"type": "array", "items": _PHASE_REF, "minItems": 1, "maxItems": MAX_FIT_PHASES}}),
             tool_plot_fit),
    ToolSpec("search_history", "Earlier experiments of the lab (before the task's date): precursors, conditions, "
             "verified phases; filter by elements (any of) or an exact chemical system.",
             _obj({"elements": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 12},
                   "chemical_system": {"type": "string", "maxLength": 60},
                   "limit": {"type": "integer", "minimum": 1, "maximum": 50}}), tool_search_history),
]}

TOOLSETS = {"full": tuple(n for n in TOOLS if n != "plot_fit"), "minimal": ("get_pattern", "simulate_phase"),
            "analyst": tuple(TOOLS)}       # analyst = full + plot_fit (needs TaskContext.plot_dir)


def toolset(name: str) -> dict[str, ToolSpec]:
    if name not in TOOLSETS:
        raise ValueError(f"unknown toolset {name!r}; choose from {', '.join(TOOLSETS)}")
    return {n: TOOLS[n] for n in TOOLSETS[name]}


def _error(message: str) -> dict:
    return {"error": clip_text(message, MESSAGE_CAP)}


def _argument_chars(args: dict) -> int:
    """Characters of ``args`` as JSON (a walk that stops once past the limit)."""
    try:
        return len(json.dumps(args, default=str, separators=(",", ":")))
    except (ValueError, RecursionError):   # circular or absurdly deep: over any limit
        return MAX_ARGUMENT_CHARS + 1


def call_tool(name: str, args: dict, ctx: TaskContext, tools: dict[str, ToolSpec] | None = None) -> dict:
    """Run one tool call; never raises (errors come back as {"error": message}, at most
    ``bounded.MESSAGE_CAP`` characters, whatever the call carried)."""
    available = tools if tools is not None else TOOLS
    try:
        if not isinstance(name, str) or name not in available:
            return _error(f"unknown tool {short_repr(name, 80)}; available: {', '.join(available)}")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return _error(f"{name}: arguments must be a JSON object, got {type(args).__name__}")
        if len(args) > MAX_ARGUMENTS:
            return _error(f"{name}: {len(args)} arguments; a tool takes at most {MAX_ARGUMENTS}")
        if _argument_chars(args) > MAX_ARGUMENT_CHARS:
            return _error(f"{name}: arguments over {MAX_ARGUMENT_CHARS} characters as JSON; send smaller values")
        spec = available[name]
        validate_args(spec.parameters, args)
        return spec.function(args, ctx)
    except ToolError as e:
        return _error(f"{name}: {e}")
    except (KeyError, ValueError, TypeError) as e:
        return _error(f"{name}: {e}")
    except Exception as e:  # noqa: BLE001 - the episode must survive any tool failure
        return _error(f"{name}: internal error ({type(e).__name__}: {e})")
