"""The client decodes routed experts in the dtype SGLang advertises (meta_info.routed_experts_dtype,
SGLANG_ROUTED_EXPERTS_DTYPE: int32 / uint16 / uint8; absent = int32) and refuses a payload whose
size does not fit the rows x layers x top_k it expects."""

from __future__ import annotations

import numpy as np
import pytest

from neon_hpc.rollout.engines import wire
from neon_hpc.rollout.engines.client import EngineClient, EngineError

LAYERS, K = 3, 2


def response(routes: np.ndarray, dtype: str | None, prompt: int = 4, out_ids=(5, 6, 7)) -> dict:
    meta = {"id": "r", "finish_reason": {"type": "length", "length": len(out_ids)}, "prompt_tokens": prompt,
            "completion_tokens": len(out_ids), "weight_version": "0",
            "routed_experts": wire.encode_routes(routes, dtype or "int32")}
    if dtype is not None:
        meta["routed_experts_dtype"] = dtype
    return {"output_ids": list(out_ids), "meta_info": meta}


def client() -> EngineClient:
    return EngineClient("http://127.0.0.1:9", num_moe_layers=LAYERS, top_k=K)   # never contacted


def routes(rows: int, hi: int) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, hi, size=(rows, LAYERS, K)).astype(np.int32)


@pytest.mark.parametrize("dtype,hi", [(None, 384), ("int32", 384), ("uint16", 384), ("uint8", 256)])
def test_decodes_each_advertised_dtype(dtype, hi):
    want = routes(6, hi)                                   # 4 prompt + 3 output tokens -> 6 rows
    got = client()._result(response(want, dtype), 4, 0).routed_experts
    assert got.dtype == np.int32 and np.array_equal(got, want)


def test_narrow_payloads_are_smaller_on_the_wire():
    want = routes(6, 200)
    sizes = {d: len(response(want, d)["meta_info"]["routed_experts"]) for d in ("int32", "uint16", "uint8")}
    assert sizes["uint8"] < sizes["uint16"] < sizes["int32"]


@pytest.mark.parametrize("dtype", ["int32", "uint16", "uint8"])
def test_payload_that_does_not_fit_is_refused(dtype):
    body = response(routes(5, 4), dtype)                   # 5 rows where 6 are expected
    with pytest.raises(EngineError, match=r"bytes; expected .*6 rows x 3 layers x top_k 2") as e:
        client()._result(body, 4, 0)
    assert e.value.status == 502


def test_payload_sent_narrow_but_advertised_int32_is_refused():
    body = response(routes(6, 4), "uint16")
    body["meta_info"]["routed_experts_dtype"] = "int32"    # half the bytes int32 would need
    with pytest.raises(EngineError, match="int32"):
        client()._result(body, 4, 0)


def test_unknown_dtype_is_refused():
    body = response(routes(6, 4), "int32")
    body["meta_info"]["routed_experts_dtype"] = "int64"
    with pytest.raises(EngineError, match="routed_experts_dtype='int64'"):
        client()._result(body, 4, 0)


def test_row_count_derived_from_payload_in_the_advertised_dtype():
    """Without num_moe_layers the client derives the rows per token from the payload size,
    which needs the right item size (uint8: a quarter of int32's bytes)."""
    c = EngineClient("http://127.0.0.1:9", top_k=K)
    c.num_moe_layers = None
    c._info_cache = {"moe_router_topk": K}
    want = routes(6, 200)
    got = c._result(response(want, "uint8"), 4, 0).routed_experts
    assert got.shape == (6, LAYERS, K) and np.array_equal(got, want)


def test_encode_refuses_ids_that_do_not_fit_the_dtype():
    with pytest.raises(ValueError, match="uint8"):
        wire.encode_routes(np.full((1, 1, 2), 300), "uint8")


def test_embedded_engine_sends_the_configured_dtype_and_the_client_decodes_it(tmp_path, monkeypatch):
    """Over HTTP: SGLANG_ROUTED_EXPERTS_DTYPE=uint8 on the (embedded) server -> a quarter of the
    int32 bytes, advertised in meta_info; the client's routes equal the int32 server's."""
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models.hf import build_hf_model, save_hf
    from neon_hpc.rollout.engines.embedded import start_server
    cfg = ModelConfig()
    path = save_hf(build_hf_model(cfg, seed=1), cfg, tmp_path / "v_0")
    got = {}
    for dtype in ("int32", "uint8"):
        monkeypatch.setenv("SGLANG_ROUTED_EXPERTS_DTYPE", dtype)
        with start_server(path, in_process=True) as srv:
            r = EngineClient(srv.url).generate([1, 2, 3, 4], {"temperature": 0.0, "max_new_tokens": 4},
                                               return_routed_experts=True)
        assert r.meta_info["routed_experts_dtype"] == dtype
        got[dtype] = (r.routed_experts, len(wire.base64.b64decode(r.meta_info["routed_experts"])))
    assert np.array_equal(got["int32"][0], got["uint8"][0]) and got["int32"][0].shape[1:] == (cfg.num_layers, 2)
    assert got["uint8"][1] * 4 == got["int32"][1]


def test_embedded_engine_refuses_a_dtype_too_narrow_for_its_experts(tmp_path, monkeypatch):
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models.hf import build_hf_model, save_hf
    from neon_hpc.rollout.engines.embedded import LoadedModel, Scheduler
    cfg = ModelConfig(num_experts=300, moe_router_topk=2, vocab_size=64, hidden_size=16, num_attention_heads=2,
                      num_query_groups=1, head_dim=8, moe_ffn_hidden_size=8, num_layers=1)
    path = save_hf(build_hf_model(cfg, seed=1), cfg, tmp_path / "v_0")
    monkeypatch.setenv("SGLANG_ROUTED_EXPERTS_DTYPE", "uint8")
    with pytest.raises(ValueError, match="cannot hold expert ids up to 299"):
        Scheduler(LoadedModel.load(path))
