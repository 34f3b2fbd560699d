"""The config model's building blocks: one pydantic v2 schema, declared beside the fields.

Each config section is a plain dataclass marked :func:`section`; pydantic validates it (types,
ranges, enums, the section's cross-field rules) and writes its JSON schema.  What a section
declares, beside its fields:

- the annotation: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``list[X]``,
  ``X | None``, another section, or a discriminated union of sections;
- ``CHECKS``: field name -> :class:`Range` (``at_least(1)``, ``above(0, le=1.0)``, ...);
- ``RULES``: :class:`Rule` objects (a predicate over the whole section, and what is allowed);
- ``CROSS`` (the experiment config only): functions ``cfg -> [(key path, message)]``, the
  rules across sections;
- ``MOVED``: old field name -> the key path it moved to (``{"tools": "env.tools (kind: xrd)"}``): a config
  that still sets the old key is refused with the new one named (``rollout.tools: moved to
  env.tools (kind: xrd); set it there``).

Every field is held to a range, declared or not:

======================  ==============================================================
annotation              what pydantic enforces
======================  ==============================================================
``float``               a finite number (no NaN, no infinity), ``>= 0`` unless declared;
                        a YAML 1.1 string such as ``1e-4`` is read as a number
``int``                 an integer (not ``1.5``, not ``"3"``), ``>= 0`` unless declared,
                        below ``2**63`` (fits int64 everywhere)
``Literal[...]``        one of the listed values
``bool`` / ``str``      exactly that type (``1`` is not ``true``, ``12`` is not a string)
``list[X]``             every item as ``X`` (a range declared for the list is its items')
``X | None``            ``None``, or as ``X``
======================  ==============================================================

A name in ``CHECKS`` or a ``Rule`` that is not a field is a programming error and raises
``TypeError`` when the class is defined.  Unknown keys are refused (``extra="forbid"``).

The same blocks check the run directory's records (:func:`strict`, ``protocol/records.py``)
and the capacity planner's ``SimParams`` (a section too, ``plan/params.py``).

A section built in code (``TrainConfig(lr=...)``) is not validated until :func:`validate`
(or the loader) sees it, as with any dataclass; the loader (:mod:`neon_hpc.config`) turns
pydantic's errors into lines that name the file, the key, the bad value and what is allowed
(:func:`explain`).  This module imports nothing of neon_hpc but :mod:`neon_hpc.util.bounded`, so
every section module can import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

import annotated_types as at
import typing_extensions
from pydantic import (
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.types import AllowInfNan

from neon_hpc.util.bounded import REPR_CAP, clip_text, short_repr

INT_MIN, INT_MAX = -(2**63), 2**63 - 1

SECTION_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


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

    def metadata(self, kind: str) -> list:
        """pydantic's constraints for this range on a field of ``kind`` ("int" or "float")."""
        out: list = []
        for name, cls in (("ge", at.Ge), ("gt", at.Gt), ("le", at.Le), ("lt", at.Lt)):
            v = getattr(self, name)
            if v is not None:
                out.append(cls(int(v) if kind == "int" and float(v).is_integer() else v))
        if kind == "int":
            if self.ge is None and self.gt is None:
                out.append(at.Ge(INT_MIN))
            if self.le is None and self.lt is None:
                out.append(at.Le(INT_MAX))
        if kind == "float" and not self.finite:
            out.append(AllowInfNan(True))
        if self.note:
            out.append(Field(description=self.note))
        return out


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


_NO_VALUE = object()


@dataclass(frozen=True)
class Violation:
    key: str          # dotted path from the top of the config, e.g. "train.lr"
    value: Any        # the bad value (_NO_VALUE: a rule across sections, shown as its message alone)
    allowed: str      # what would be accepted (or, across sections, what is wrong and the fix)

    def __str__(self) -> str:
        if self.value is _NO_VALUE:
            return f"{self.key}: {self.allowed}"
        return f"{self.key}: got {short_repr(self.value)}; allowed: {self.allowed}"


class RuleViolations(ValueError):
    """What a section's ``RULES`` (or the experiment's ``CROSS``) refuse; keys relative to the section."""

    def __init__(self, violations: list[Violation]):
        super().__init__("; ".join(str(v) for v in violations))
        self.violations = violations


# --------------------------------------------------------------------------------------
# declaring a section

def _yaml_float(v: Any) -> Any:
    # YAML 1.1 reads 1e-4 (no dot) as a string; accept what float() accepts
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp) and hasattr(tp, "__neon_hints__")


def _pydantic_type(tp: Any, rng: Range | None, ranges: bool = True) -> Any:
    """``tp`` as pydantic should validate it: strict scalars, YAML floats, and (``ranges``) the
    declared range or the default one."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        if union_members(tp) is not None:     # a discriminated union of sections: declared for pydantic
            return tp
        return Annotated[_pydantic_type(typing.get_args(tp)[0], rng, ranges), *tp.__metadata__]
    if tp is bool or tp is str:
        return Annotated[tp, Strict()]
    if tp is int:
        return Annotated[int, Strict(), *((rng or DEFAULT).metadata("int") if ranges else ())]
    if tp is float:
        return Annotated[float, Strict(), *((rng or DEFAULT).metadata("float") if ranges else ()),
                         BeforeValidator(_yaml_float)]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(a if a is type(None) else _pydantic_type(a, rng, ranges)
                                  for a in typing.get_args(tp))]
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return list[_pydantic_type(item, rng, ranges)]
    return tp


def strict(tp: Any) -> Any:
    """``tp`` with strict scalars and no ranges (what a record of the run directory holds:
    an ``int`` is not ``true``, a ``float`` may be written as ``3``)."""
    return _pydantic_type(tp, None, ranges=False)


def _run_rules(obj: Any) -> Any:
    cls = type(obj)
    out = []
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}
    for r in getattr(cls, "RULES", ()) or ():
        if not r.ok(obj):
            out.append(Violation(r.key, values[r.key], r.explain(obj, values)))
    if not out:
        for check in getattr(cls, "CROSS", ()) or ():
            out += [Violation(k, _NO_VALUE, m) for k, m in check(obj)]
    if out:
        raise RuleViolations(out)
    return obj


def section(cls: type) -> type:
    """Mark a dataclass as a config section: pydantic validates it from its annotations,
    ``CHECKS``, ``RULES`` (and ``CROSS``), refusing unknown keys."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: @section goes above @dataclass")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = {f.name for f in dataclasses.fields(cls)}
    checks = dict(getattr(cls, "CHECKS", {}) or {})
    wrong = sorted(set(checks) - names)
    if wrong:
        raise TypeError(f"{cls.__name__}.CHECKS names {', '.join(wrong)}: not fields of {cls.__name__}")
    for r in getattr(cls, "RULES", ()) or ():
        if r.key not in names:
            raise TypeError(f"{cls.__name__}.RULES: rule for {r.key!r}, not a field of {cls.__name__}")
    stays = sorted(set(getattr(cls, "MOVED", {}) or {}) & names)
    if stays:
        raise TypeError(f"{cls.__name__}.MOVED names {', '.join(stays)}: still fields of {cls.__name__}")
    cls.__neon_hints__ = {f.name: hints[f.name] for f in dataclasses.fields(cls)}   # in field order
    own = cls.__dict__.get("__annotations__", {})
    new = {}
    for f in dataclasses.fields(cls):
        tp = _pydantic_type(hints[f.name], checks.get(f.name) or _inherited_range(cls, f.name))
        f.type = tp
        if f.name in own:
            new[f.name] = tp
    cls.__annotations__ = {**own, **new}
    cls.__pydantic_config__ = SECTION_CONFIG
    cls._neon_rules = model_validator(mode="after")(_run_rules)
    return cls


def _inherited_range(cls: type, name: str) -> Range | None:
    for base in cls.__mro__[1:]:
        rng = (base.__dict__.get("CHECKS") or {}).get(name)
        if rng is not None:
            return rng
    return None


def union_of(members: dict[str, type], tag_field: str, default: str,
             aliases: dict[str, str] | None = None, other: str | None = None) -> Any:
    """A discriminated union of sections: ``members`` maps a tag to its section; a mapping's
    ``tag_field`` chooses (``default`` when absent; ``aliases`` name other spellings of a tag;
    ``other``: the member any other tag gets, whose own rules judge it)."""
    aliases = aliases or {}

    def tag(v: Any) -> Any:
        t = v.get(tag_field, default) if isinstance(v, dict) else getattr(v, tag_field, None)
        t = aliases.get(t, t) if isinstance(t, str) else t
        return t if other is None or (isinstance(t, str) and t in members) else other

    union = typing.Union[tuple(Annotated[c, Tag(t)] for t, c in members.items())]
    return Annotated[union, Discriminator(tag)]


def union_members(tp: Any) -> dict[str, type] | None:
    """``{tag: section}`` of a union built by :func:`union_of`, else None."""
    if typing.get_origin(tp) is not Annotated or not any(isinstance(m, Discriminator) for m in tp.__metadata__):
        return None
    out = {}
    for a in typing.get_args(typing.get_args(tp)[0]):
        tags = [m for m in a.__metadata__ if isinstance(m, Tag)]
        out[tags[0].tag] = typing.get_args(a)[0]
    return out


# --------------------------------------------------------------------------------------
# validating, and saying what is wrong

@functools.lru_cache(maxsize=None)
def adapter(cls: Any) -> TypeAdapter:
    """pydantic's validator (and JSON schema) for a section, built once."""
    return TypeAdapter(cls)


def hints(cls: type) -> dict[str, Any]:
    """The annotations a section was declared with (before :func:`section` made them strict)."""
    return cls.__neon_hints__


def range_of(cls: type, name: str) -> Range:
    """The range a numeric field of ``cls`` is held to (declared, else :data:`DEFAULT`)."""
    return (getattr(cls, "CHECKS", {}) or {}).get(name) or _inherited_range(cls, name) or DEFAULT


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    members = union_members(tp)
    if members is not None:
        return "a mapping (one of sections " + ", ".join(c.__name__ for c in members.values()) + ")"
    if origin is Annotated:
        return type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp is type(None):
        return "null"
    if typing_extensions.is_typeddict(tp):
        return "{" + ", ".join(f"{k!r}: {type_name(v)}" for k, v in typing.get_type_hints(tp).items()) + "}"
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {type_name(args[0]) if args else 'values'}"
    if origin is dict:
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping (section {tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is Annotated and union_members(tp) is None:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and union_members(tp) is None:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


@dataclass
class _Where:
    key: str                   # dotted key path, e.g. "launch.rollout.nodes"
    cls: type | None           # the section holding the last key (None above the root)
    name: str | None           # the field name in cls
    tp: Any                    # its declared annotation
    section: type | None       # the section the path ends in, when it ends in one


def _walk(root: type, loc: tuple) -> _Where:
    key, name, tp, parent = "", None, root, None
    i = 0
    while i < len(loc):
        part = loc[i]
        if isinstance(part, int):
            key += f"[{part}]"
            args = typing.get_args(_strip_optional(tp))
            tp = args[0] if args else Any
            i += 1
            continue
        members = union_members(tp)
        if members is not None and part in members:
            tp = members[part]
            i += 1
            continue
        sec = _strip_optional(tp)
        if not _is_section(sec):
            key += f".{part}"
            i += 1
            continue
        parent, name = sec, str(part)
        tp = hints(sec).get(name, Any)
        key = f"{key}.{part}" if key else str(part)
        i += 1
    end = _strip_optional(tp)
    return _Where(key, parent, name, tp, end if _is_section(end) else None)


def _unknown_key(root: type, loc: tuple, value: Any) -> str:
    w = _walk(root, loc[:-1])
    sec = w.section if w.key else root
    prefix = w.key + "." if w.key else ""
    k = str(loc[-1])
    names = list(hints(sec)) if sec is not None else []
    path = clip_text(prefix + k, REPR_CAP)
    moved = (getattr(sec, "MOVED", None) or {}).get(k) if sec is not None else None
    if moved:
        return f"{path}: moved to {moved}; set it there"
    siblings = _union_siblings(root, loc[:-1])
    owners = [t for t, c in siblings.items() if k in hints(c) and c is not sec]
    if owners:
        tag_field, tag = getattr(sec, "TAG_FIELD", "arch"), next(t for t, c in siblings.items() if c is sec)
        this = f"{tag_field} {tag}" if tag in typing.get_args(hints(sec).get(tag_field)) else f"this {tag_field}"
        return (f"{path}: a field of {tag_field} {' / '.join(owners)}, not of {this}: remove it, "
                f"or set {prefix}{tag_field}: {owners[0]}")
    close = difflib.get_close_matches(k, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys here: {', '.join(names)}"
    return f"{path}: unknown key{hint}"


def _union_siblings(root: type, loc: tuple) -> dict[str, type]:
    """The members of the union the path ``loc`` (ending in a tag) passes through, else {}."""
    if not loc:
        return {}
    w = _walk(root, loc[:-1])
    return union_members(w.tp) or {}


def _scalar(tp: Any) -> Any:
    """The scalar type of a field (``int`` for ``list[int]`` or ``int | None``)."""
    tp = _strip_optional(tp)
    if typing.get_origin(tp) is list:
        tp = _strip_optional((typing.get_args(tp) or (Any,))[0])
    return tp


def _bad_type(w: _Where, value: Any) -> str:
    tp = _strip_optional(w.tp) if value is not None else w.tp
    extra = ""
    if typing.get_origin(tp) is Literal:
        close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
        extra = f"; did you mean {close[0]!r}?" if close else ""
    elif tp is bool:
        extra = "; write true or false"
    elif tp is str:
        extra = "; quote it in YAML"
    return f"{w.key}: expected {type_name(w.tp)}, got {short_repr(value)} ({type(value).__name__}){extra}"


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def explain(root: type, exc: ValidationError, prefix: str = "") -> list[str]:
    """One line per error of ``exc`` (raised validating section ``root``): the key path, the bad
    value and what is allowed (or the fix)."""
    out: list[str] = []
    for e in exc.errors(include_url=False):
        loc, kind, value = tuple(e["loc"]), e["type"], e.get("input")
        if kind == "unexpected_keyword_argument":
            out.append(_unknown_key(root, loc, value))
            continue
        w = _walk(root, loc)
        if kind == "value_error" and isinstance((e.get("ctx") or {}).get("error"), RuleViolations):
            base = w.key + "." if w.key else ""
            out += [str(dataclasses.replace(v, key=base + v.key)) for v in e["ctx"]["error"].violations]
            continue
        if kind in ("union_tag_invalid", "union_tag_not_found") and not isinstance(value, dict):
            out.append(_bad_type(w, value))
            continue
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            members = union_members(w.tp) or {}
            tag_field = next(iter(members.values())).TAG_FIELD if members else "kind"
            allowed = [a for c in members.values() for a in typing.get_args(hints(c)[tag_field])]
            tag = value.get(tag_field) if isinstance(value, dict) else value
            close = difflib.get_close_matches(str(tag), [str(a) for a in allowed], n=1)
            out.append(f"{w.key}.{tag_field}: expected one of {', '.join(repr(a) for a in allowed)}, got "
                       f"{short_repr(tag)}" + (f"; did you mean {close[0]!r}?" if close else ""))
            continue
        if kind in _RANGE_ERRORS and w.cls is not None:
            allowed = range_of(w.cls, w.name).describe("int" if _scalar(w.tp) is int else "float")
            out.append(f"{w.key}: got {short_repr(value)}; allowed: {allowed}")
            continue
        if kind.endswith("_type") or kind.endswith("_parsing") or kind in ("literal_error", "int_from_float",
                                                                            "dataclass_type", "dataclass_args_type"):
            out.append(_bad_type(w, value))
            continue
        out.append(f"{w.key}: {e['msg']}")
    return out


def validate(obj: Any) -> Any:
    """Validate a section built in code (and the sections nested in it); raises ValidationError."""
    return adapter(type(obj)).validate_python(dataclasses.asdict(obj))


def errors(obj: Any) -> list[tuple[str, str]]:
    """``[(field, message), ...]`` for one section built in code (empty = valid)."""
    try:
        validate(obj)
    except ValidationError as e:
        return [tuple(line.split(": ", 1)) for line in explain(type(obj), e)]   # type: ignore[misc]
    return []


def json_schema(cls: type) -> dict:
    """The JSON schema of a section (editors complete configs from it).  A union of sections is
    written ``anyOf``: its tag has a default, so a mapping without it may match more than one."""
    def any_of(node: Any) -> Any:
        if isinstance(node, dict):
            return {("anyOf" if k == "oneOf" else k): any_of(v) for k, v in node.items()}
        if isinstance(node, list):
            return [any_of(v) for v in node]
        return node
    return any_of(adapter(cls).json_schema())
