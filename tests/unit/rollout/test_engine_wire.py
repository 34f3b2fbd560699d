"""The wire format, without a server: route payload encoding and request validation."""
import base64

import numpy as np
import pytest

from neon_hpc.rollout.engines import wire
from neon_hpc.rollout.engines.client import EngineClient


def test_routes_roundtrip_as_little_endian_int32():
    routes = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    payload = wire.encode_routes(routes)
    assert base64.b64decode(payload) == routes.astype("<i4").tobytes()
    assert np.array_equal(wire.decode_routes(payload, 5, 3, 2), routes)


def test_decode_routes_checks_the_byte_length():
    payload = wire.encode_routes(np.zeros((4, 2, 2), np.int32))
    with pytest.raises(ValueError, match="expected 48"):
        wire.decode_routes(payload, 3, 2, 2)


def test_routed_rows_cover_start_to_seqlen_minus_one():
    assert wire.routed_rows(10, 5, 0) == 14
    assert wire.routed_rows(10, 5, 9) == 5
    assert wire.routed_rows(1, 0, 0) == 0


def test_parse_generate_defaults_and_batch():
    (r,) = wire.parse_generate({"input_ids": [1, 2]}, 256)
    assert r.sampling.max_new_tokens == 128 and r.routed_experts_start_len == 0 and not r.return_logprob
    reqs = wire.parse_generate({"input_ids": [[1], [2, 3]], "sampling_params": [{"temperature": 0}, {}],
                                    "rid": "x"}, 256)
    assert [q.input_ids for q in reqs] == [[1], [2, 3]] and reqs[0].sampling.temperature == 0
    assert [q.rid for q in reqs] == ["x-0", "x-1"]


def test_bool_is_not_a_number():
    with pytest.raises(wire.BadRequest, match="temperature"):
        wire.parse_generate({"input_ids": [1], "sampling_params": {"temperature": True}}, 256)


def test_client_sends_sglang_names(monkeypatch):
    sent = {}

    def fake(self, method, path, body=None, timeout=None):
        sent.update(body)
        return {"output_ids": [7], "meta_info": {"prompt_tokens": 2, "weight_version": "3",
                                                 "finish_reason": {"type": "length", "length": 1},
                                                 "output_token_logprobs": [[-0.5, 7, None]],
                                                 "routed_experts": wire.encode_routes(np.ones((1, 2, 2)))}}

    monkeypatch.setattr(EngineClient, "_request", fake)
    c = EngineClient("http://x", num_moe_layers=2, top_k=2)
    res = c.generate([1, 2], {"temperature": 1.0, "seed": 5}, return_routed_experts=True,
                     routed_experts_start_len=1)
    assert sent["sampling_params"] == {"temperature": 1.0, "sampling_seed": 5}
    assert sent["routed_experts_start_len"] == 1 and sent["return_routed_experts"] is True
    assert res.weight_version == "3" and res.output_logprobs == [-0.5]
    assert res.routed_experts.shape == (1, 2, 2)  # [start=1, seqlen-1=2)


def test_client_connection_errors_are_oserrors():
    c = EngineClient("http://127.0.0.1:9", timeout=2)
    assert not c.health(timeout=1)
    with pytest.raises(ConnectionError):
        c.model_info()


def test_client_derives_route_shape_like_against_a_real_sglang(monkeypatch, tmp_path):
    """SGLang's /get_model_info has model_path but no MoE shape: top-k from its config.json,
    layers from the payload size."""
    (tmp_path / "config.json").write_text('{"num_experts_per_tok": 2, "num_hidden_layers": 3}')
    routes = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)

    def fake(self, method, path, body=None, timeout=None):
        if path == "/get_model_info":
            return {"model_path": str(tmp_path), "is_generation": True, "weight_version": "default"}
        return {"output_ids": [9, 8], "meta_info": {"prompt_tokens": 3, "weight_version": "default",
                                                    "finish_reason": {"type": "length", "length": 2},
                                                    "routed_experts": wire.encode_routes(routes)}}

    monkeypatch.setattr(EngineClient, "_request", fake)
    res = EngineClient("http://x").generate([1, 2, 3], {}, return_logprob=False, return_routed_experts=True)
    assert np.array_equal(res.routed_experts, routes) and res.output_logprobs is None
