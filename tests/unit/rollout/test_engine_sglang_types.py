"""What our client sends is what SGLang's own request types accept.

SGLang cannot be imported on this machine (its ``io_struct`` pulls in triton, a torchvision
built for its torch, and its GPU scheduler), so the types are read from the source of the
pinned wheel (``env/setup.sh`` downloads ``sglang==0.5.23`` without installing it):
``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``, ``PauseGenerationReqInput``,
``ContinueGenerationReqInput`` in ``srt/managers/io_struct.py`` and ``SamplingParams`` in
``srt/sampling/sampling_params.py``. Every body ``EngineClient`` sends, captured on the wire,
must use only their field names, and values of the declared kind.
"""
from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest

from neon_hpc.rollout.engines.client import EngineClient
from repo_paths import REPO
from sglang_wire import RecordingServer

SGLANG_VERSION = "0.5.23"
WHEELS = REPO / ".cache" / "wheels"


def _wheel() -> Path:
    found = sorted(WHEELS.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        pytest.skip(f"sglang {SGLANG_VERSION} wheel not in {WHEELS}: run `bash env/setup.sh` (downloads it)")
    return found[0]


def _class_fields(source: str, name: str) -> dict[str, str]:
    """Annotated class-level fields of ``name`` (dataclass / msgspec.Struct): name -> annotation."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {st.target.id: ast.unparse(st.annotation) for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    raise AssertionError(f"class {name} not found in SGLang {SGLANG_VERSION}'s source")


@pytest.fixture(scope="module")
def sglang_types() -> dict[str, dict[str, str]]:
    with zipfile.ZipFile(_wheel()) as z:
        io_src = z.read("sglang/srt/managers/io_struct.py").decode()
        sp_src = z.read("sglang/srt/sampling/sampling_params.py").decode()
    out = {n: _class_fields(io_src, n) for n in ("GenerateReqInput", "UpdateWeightFromDiskReqInput",
                                                  "PauseGenerationReqInput", "ContinueGenerationReqInput")}
    out["SamplingParams"] = _class_fields(sp_src, "SamplingParams")
    return out


_KIND = {bool: ("bool",), int: ("int",), float: ("float", "int"), str: ("str",), list: ("List", "list", "Set"),
         dict: ("Dict", "dict")}


def _fits(value, annotation: str) -> bool:
    """A loose check that a JSON value is of the annotation's kind (Optional/Union aware)."""
    if value is None:
        return "Optional" in annotation or "None" in annotation
    if annotation.startswith("Literal["):
        return value in ast.literal_eval(annotation[len("Literal"):])
    return any(k in annotation for k in _KIND[type(value)])


def test_every_request_the_client_sends_fits_sglangs_request_types(sglang_types):
    srv = RecordingServer()
    c = EngineClient(srv.url, timeout=30)
    sp = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 8, "min_new_tokens": 0,
          "stop_token_ids": [2], "ignore_eos": False, "seed": 5, "skip_special_tokens": False, "no_stop_trim": True}
    c.generate([1, 2, 3], sp, return_logprob=True, return_routed_experts=True, routed_experts_start_len=2, rid="r")
    c.generate([1, 2, 3], {"max_new_tokens": 1}, return_logprob=False, return_routed_experts=True)
    c.update_weights_from_disk("/w/v_1", weight_version=1, abort_all_requests=True, flush_cache=False)
    c.pause_generation("in_place")
    c.continue_generation()
    srv.shutdown()
    types = {"/generate": "GenerateReqInput", "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
             "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput"}
    assert {p for p, _ in srv.posts} == set(types)
    for path, body in srv.posts:
        fields = sglang_types[types[path]]
        for k, v in body.items():
            assert k in fields, f"{path}: {k!r} is not a field of SGLang's {types[path]}"
            assert _fits(v, fields[k]), f"{path}: {k}={v!r} does not fit {types[path]}.{k}: {fields[k]}"
        if path == "/generate":
            for k, v in body["sampling_params"].items():
                assert k in sglang_types["SamplingParams"], f"sampling_params.{k} is not a SamplingParams field"
                assert _fits(v, sglang_types["SamplingParams"][k]), (k, v, sglang_types["SamplingParams"][k])


def test_the_fields_delta_replay_and_in_place_updates_rely_on_exist_upstream(sglang_types):
    gen = sglang_types["GenerateReqInput"]
    assert {"return_routed_experts", "routed_experts_start_len", "return_logprob", "rid"} <= set(gen)
    assert "in_place" in sglang_types["PauseGenerationReqInput"]["mode"]
    assert "flush_cache" in sglang_types["UpdateWeightFromDiskReqInput"]


def test_the_engines_own_protocol_accepts_only_sglang_fields(sglang_types):
    from neon_hpc.rollout.engines.wire import NEUTRAL_FIELDS, REQUEST_FIELDS, SAMPLING_FIELDS
    # "model" is the router's own field (it sends model: null); SGLang's request type has none
    assert set(REQUEST_FIELDS) | (set(NEUTRAL_FIELDS) - {"model"}) <= set(sglang_types["GenerateReqInput"])
    assert set(SAMPLING_FIELDS) <= set(sglang_types["SamplingParams"])
