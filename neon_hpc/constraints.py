"""Declared ranges of config fields, and the one checker that enforces them.

Every field of every config section is checked here, whether or not its section declares
anything about it.  Undeclared fields get a default from their annotation:

======================  ==============================================================
annotation              default check
======================  ==============================================================
``float``               a finite number (no NaN, no infinity) ``>= 0``
``int``                 an integer ``>= 0`` and below ``2**63`` (fits int64 everywhere)
``Literal[...]``        one of the listed values (checked when the YAML is read)
``bool`` / ``str``      its type (checked when the YAML is read)
``list[X]``             every item as ``X``
``X | None``            ``None``, or as ``X``
======================  ==============================================================

A section declares other ranges and cross-field rules in two class attributes (plain
class attributes, not dataclass fields), beside the fields they describe::

    @dataclass
    class TrainConfig:
        steps: int = 8
        lr: float = 1e-3
        ...
        CHECKS = {"steps": between(1, 10**9), "lr": above(0, le=1.0)}
        RULES = (Rule("clip_eps", lambda c: ..., "must be ... ({tis_cap})"),)

``CHECKS`` maps a field name to a :class:`Range` (integers stay below ``2**63`` and floats
stay finite whatever the range says, unless ``Range(finite=False)``).  A ``Rule`` is a
predicate over the whole section plus what is allowed, shown when it is false (a format
string over the section's fields, or a function of the section).  A name in ``CHECKS`` or a
``Rule`` that is not a field is a programming error and raises ``TypeError`` at once.  A
check that needs code (e.g. per-architecture adapters) may stay a ``validate()`` method
returning ``[(field, message)]``; its findings are reported the same way, after the ranges
and rules pass.  Rules across sections live in ``neon_hpc.config._cross_checks``.

:func:`check` walks a config (sections nested to any depth) and returns every violation as
``(key path, value, what is allowed)``; :mod:`neon_hpc.config` turns them into one error
that names the file, the key, the bad value and the allowed range.  This module imports
nothing of neon_hpc, so every section module can import it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

from neon_hpc.bounded import short_repr

INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def _num(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric field: bounds (inclusive ``ge``/``le``, exclusive
    ``gt``/``lt``), whether a float may be infinite, and a note on special values."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True
    note: str = ""

    def admits(self, v: float) -> bool:
        if isinstance(v, float) and math.isnan(v):
            return False
        if isinstance(v, float) and math.isinf(v) and self.finite:
            return False
        return not ((self.ge is not None and not v >= self.ge) or (self.gt is not None and not v > self.gt)
                    or (self.le is not None and not v <= self.le) or (self.lt is not None and not v < self.lt))

    def describe(self, kind: str) -> str:
        lo = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None)
        hi = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None)
        if lo and hi:
            span = f"in {lo}, {hi}"
        elif lo:
            span = (">= " if lo[0] == "[" else "> ") + lo[1:]
        elif hi:
            span = ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
        else:
            span = "of any value"
        what = {"int": "an integer", "float": "a finite number" if self.finite else "a number"}[kind]
        return f"{what} {span}" + (f" ({self.note})" if self.note else "")


def at_least(x: float, note: str = "", **kw) -> Range:
    return Range(ge=x, note=note, **kw)


def above(x: float, note: str = "", **kw) -> Range:
    return Range(gt=x, note=note, **kw)


def between(lo: float, hi: float, note: str = "", **kw) -> Range:
    return Range(ge=lo, le=hi, note=note, **kw)


ANY = Range(ge=None)               # any finite float / any int64
DEFAULT = Range(ge=0)              # what an undeclared int or float field gets


@dataclass(frozen=True)
class Rule:
    """A cross-field rule of one section: ``ok(section)`` must hold; ``message`` (a format
    string over the section's fields, or a function of the section) is shown under ``key``."""

    key: str
    ok: Callable[[Any], bool]
    message: str | Callable[[Any], str]

    def explain(self, obj: Any, values: dict[str, Any]) -> str:
        return self.message(obj) if callable(self.message) else self.message.format(**values)


@dataclass(frozen=True)
class Violation:
    key: str          # dotted path from the top of the config, e.g. "train.lr"
    value: Any
    allowed: str      # what would be accepted

    def __str__(self) -> str:
        return f"{self.key}: got {short_repr(self.value)}; allowed: {self.allowed}"


# --------------------------------------------------------------------------------------
# the checker

def _numeric_kind(tp: Any) -> str | None:
    if tp is bool:
        return None
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    return None


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, computed once per class (config loads are frequent in tests)."""
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def declared(cls: type) -> dict[str, Range]:
    """The section's ``CHECKS``, after making sure every name in it is a field."""
    checks = dict(getattr(cls, "CHECKS", {}) or {})
    names = {f.name for f in dataclasses.fields(cls)}
    wrong = sorted(set(checks) - names)
    if wrong:
        raise TypeError(f"{cls.__name__}.CHECKS names {', '.join(wrong)}: not fields of {cls.__name__}")
    for r in getattr(cls, "RULES", ()) or ():
        if r.key not in names:
            raise TypeError(f"{cls.__name__}.RULES: rule for {r.key!r}, not a field of {cls.__name__}")
    return checks


def range_of(cls: type, name: str) -> Range:
    """The range a numeric field of ``cls`` is held to (declared, else :data:`DEFAULT`)."""
    return declared(cls).get(name, DEFAULT)


def _check_value(tp: Any, value: Any, rng: Range, key: str, out: list[Violation]) -> None:
    origin = typing.get_origin(tp)
    if value is None:
        return
    if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(value):
        out.extend(check(value, key))
        return
    if origin in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if a is not type(None) and _accepts(a, value):
                _check_value(a, value, rng, key, out)
                return
        return
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [Any]
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                _check_value(args[min(i, len(args) - 1)], v, rng, f"{key}[{i}]", out)
        return
    if origin is Literal:
        if value not in typing.get_args(tp):
            out.append(Violation(key, value, "one of " + ", ".join(repr(a) for a in typing.get_args(tp))))
        return
    kind = _numeric_kind(tp)
    if kind is None or isinstance(value, bool):
        return
    if kind == "int":
        if not isinstance(value, int):
            out.append(Violation(key, value, rng.describe("int")))
        elif not (INT_MIN <= value <= INT_MAX) or not rng.admits(value):
            out.append(Violation(key, value, rng.describe("int")))
        return
    if not isinstance(value, (int, float)) or not rng.admits(float(value)):
        out.append(Violation(key, value, rng.describe("float")))


def _accepts(tp: Any, value: Any) -> bool:
    if dataclasses.is_dataclass(tp):
        return dataclasses.is_dataclass(value)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is Literal:
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def check(obj: Any, prefix: str = "") -> list[Violation]:
    """Every violation in the config section ``obj`` and the sections nested in it."""
    cls = type(obj)
    checks = declared(cls)
    hints = type_hints(cls)
    out: list[Violation] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        _check_value(hints[f.name], getattr(obj, f.name), checks.get(f.name, DEFAULT), key, out)
    if out:
        return out   # cross-field rules assume each field is in range
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}
    for r in getattr(cls, "RULES", ()) or ():
        if not r.ok(obj):
            key = f"{prefix}.{r.key}" if prefix else r.key
            out.append(Violation(key, values[r.key], r.explain(obj, values)))
    # a section may still carry a hand-written validate() -> [(field, message)] (checks that
    # need code, e.g. per-architecture adapters): its findings are reported the same way
    if not out and callable(getattr(obj, "validate", None)):
        for name, msg in obj.validate() or ():
            key = f"{prefix}.{name}" if prefix else name
            out.append(Violation(key, values.get(name.split(".")[0].split("[")[0]), msg))
    return out


def errors(obj: Any) -> list[tuple[str, str]]:
    """``[(field, message), ...]`` for one section: what code that builds a section
    directly (not from YAML) reports."""
    return [(v.key, f"got {short_repr(v.value)}; allowed: {v.allowed}") for v in check(obj)]
