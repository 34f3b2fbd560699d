"""Tool arguments are checked by the jsonschema package (draft 2020-12), not a hand-written subset.

The tool functions never see arguments that break their schema, whatever JSON Schema keywords
the schema uses; the refusal names the tool, the argument and what it allows, and stays bounded.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from neon_hpc.envs.xrd.science.tools import TOOLS, ToolSpec, call_tool
from neon_hpc.util.bounded import MESSAGE_CAP

# keywords the earlier hand-written subset ignored (pattern, exclusiveMinimum, uniqueItems, const,
# minLength, minProperties) or crashed on (a list of types, "null"), inside nested array items
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["label"],
    "properties": {
        "label": {"type": "string", "pattern": "^([A-Z][a-z]?[0-9]*)?$", "minLength": 1, "maxLength": 8},
        "scale": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 10},
        "mode": {"enum": ["fast", "full"]},
        "version": {"const": 2},
        "peaks": {"type": "array", "uniqueItems": True, "maxItems": 4,
                  "items": {"type": "object", "additionalProperties": False, "required": ["x"],
                            "minProperties": 1,
                            "properties": {"x": {"type": "number", "minimum": 0, "maximum": 180},
                                           "hkl": {"type": "array", "items": {"type": "integer"},
                                                   "minItems": 3, "maxItems": 3}}}},
    },
}


@pytest.fixture()
def probe():
    calls = []
    spec = ToolSpec("probe", "records what it was called with", SCHEMA, lambda args, ctx: calls.append(args) or {})
    return {"probe": spec}, calls


@pytest.mark.parametrize("args,needle", [
    ({"label": "ni"}, "label: must match '^([A-Z][a-z]?[0-9]*)?$', got 'ni'"),
    ({"label": ""}, "label: needs at least 1 character"),
    ({"label": "Ni", "scale": 0}, "scale: must be > 0, got 0"),
    ({"label": "Ni", "scale": "big"}, "scale: expected number or null, got str 'big'"),
    ({"label": "Ni", "mode": "slow"}, "mode: must be one of ['fast', 'full'], got 'slow'"),
    ({"label": "Ni", "version": 3}, "version: must be 2, got 3"),
    ({"label": "Ni", "peaks": [{"x": 1}, {"x": 1}]}, "peaks: items must be unique"),
    ({"label": "Ni", "peaks": [{"x": 1, "colour": "red"}]}, "peaks[0]: unknown key(s) colour; valid: x, hkl"),
    ({"label": "Ni", "peaks": [{"x": 200}]}, "peaks[0].x: must be <= 180, got 200"),
    ({"label": "Ni", "peaks": [{"x": 1, "hkl": [1, 1, 1.5]}]}, "peaks[0].hkl[2]: expected integer, got float 1.5"),
    ({"label": "Ni", "peaks": [{"x": 1, "hkl": [1, 1]}]}, "peaks[0].hkl: needs at least 3 item(s)"),
    ({"label": "Ni", "peaks": [{"x": float("inf")}]}, "peaks[0].x: must be a finite number"),
    ({"label": "Ni", "peaks": [{}]}, "peaks[0]: missing required argument(s) x"),
    ({"scale": 1, "extra": 1}, "probe: arguments: missing required argument(s) label"),   # before unknown
])
def test_schema_violations_are_refused_by_name(probe, args, needle):
    tools, calls = probe
    out = call_tool("probe", args, None, tools=tools)
    assert set(out) == {"error"}, out
    assert needle in out["error"] and out["error"].startswith("probe: ")
    assert calls == []                               # the tool never ran


def test_valid_arguments_reach_the_tool(probe):
    tools, calls = probe
    ok = {"label": "Ti2", "scale": None, "mode": "full", "version": 2, "peaks": [{"x": 27.4, "hkl": [1, 1, 0]}]}
    assert call_tool("probe", ok, None, tools=tools) == {}
    assert call_tool("probe", {"label": "O", "scale": 10.0}, None, tools=tools) == {}
    assert calls == [ok, {"label": "O", "scale": 10.0}]


def test_many_bad_values_give_one_bounded_message(probe):
    tools, calls = probe
    # under the size cap
    args = {"label": "x" * 3000, "peaks": [{"x": -1, "hkl": ["a" * 500] * 3}] * 4, "mode": "m" * 3000}
    out = call_tool("probe", args, None, tools=tools)
    assert len(out["error"]) <= MESSAGE_CAP and len(json.dumps(out)) < 600, out
    assert out["error"].startswith("probe: label: ") and calls == []


def test_every_tool_schema_is_valid_json_schema_with_bounded_strings():
    def strings(schema):
        if schema.get("type") == "string":
            yield schema
        for sub in schema.get("properties", {}).values():
            yield from strings(sub)
        if isinstance(schema.get("items"), dict):
            yield from strings(schema["items"])

    for spec in TOOLS.values():
        jsonschema.Draft202012Validator.check_schema(spec.parameters)
        assert spec.parameters["additionalProperties"] is False
        assert all("maxLength" in s for s in strings(spec.parameters)), spec.name


def test_broken_schema_is_an_internal_error_not_a_pass():
    calls = []
    bad = ToolSpec("bad", "schema with a wrong keyword value", {"type": "object", "properties": {"n": {"type": "int"}}},
                   lambda args, ctx: calls.append(args) or {})
    out = call_tool("bad", {"n": 1}, None, tools={"bad": bad})
    assert "internal error" in out["error"] and "SchemaError" in out["error"] and calls == []
