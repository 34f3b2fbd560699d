"""SGLang's real load balancer (sglang-router, pinned) between our client and two SGLang-shaped servers.

Pins what the fleet relies on and why ``engine.load_balancer`` defaults to ``mini_lb``:
- both balancers add the PD bootstrap fields and send each request to a prefill and a decode
  server;
- the Python balancer (``--mini-lb``) forwards the body as sent, routed-experts fields
  included; the Rust one (sglang-router's default) re-serialises it through a typed request that
  drops ``return_routed_experts`` / ``routed_experts_start_len`` (sglang-router 0.3.2). If an
  upgrade starts forwarding them, the second test fails and says so;
- our engine accepts the neutral extra fields the Rust load balancer adds, and refuses them when they
  ask for something it does not do.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from neon_hpc.rollout.engines.client import EngineClient
from neon_hpc.rollout.engines.wire import BadRequest, parse_generate
from neon_hpc.util.netutil import free_port
from repo_paths import REPO
from sglang_wire import RecordingServer

TINY = str(REPO / "configs" / "tiny_cpu.yaml")
pytest.importorskip("sglang_router", reason="sglang-router is in the test extra: run `bash env/setup.sh`")


@pytest.fixture(params=["mini_lb", "rust"])
def load_balancer(request, tmp_path):
    prefill, decode = RecordingServer(), RecordingServer()
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           *(["--mini-lb"] if request.param == "mini_lb" else []),
           "--prefill", prefill.url, "8998", "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port)]
    log = open(tmp_path / "load_balancer.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=30)
    end = time.monotonic() + 60
    while not client.health(timeout=2):
        assert proc.poll() is None, (tmp_path / "load_balancer.log").read_text()[-2000:]
        assert time.monotonic() < end, "load balancer not healthy in 60 s"
        time.sleep(0.3)
    # the Rust load balancer marks its workers healthy shortly after it answers /health itself
    yield request.param, client, prefill, decode
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    prefill.shutdown()
    decode.shutdown()


def _generate(client: EngineClient) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 2, "rid": "r1"}
    end = time.monotonic() + 30
    while True:
        try:
            client._request("POST", "/generate", body)
            return
        except Exception:   # the load balancer may still be registering its workers
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def test_load_balancer_sends_each_request_to_prefill_and_decode_with_bootstrap_fields(load_balancer):
    kind, client, prefill, decode = load_balancer
    _generate(client)
    p, d = prefill.bodies[-1], decode.bodies[-1]
    assert p["bootstrap_room"] == d["bootstrap_room"] and p["bootstrap_port"] == 8998
    assert p["bootstrap_host"] == "127.0.0.1" and p["input_ids"] == [1, 2, 3] and p["rid"] == "r1"


def test_only_the_python_balancer_forwards_the_routed_experts_fields(load_balancer):
    kind, client, prefill, decode = load_balancer
    _generate(client)
    got = {k: decode.bodies[-1].get(k) for k in ("return_routed_experts", "routed_experts_start_len")}
    if kind == "mini_lb":
        assert got == {"return_routed_experts": True, "routed_experts_start_len": 2}
    else:
        assert got == {"return_routed_experts": None, "routed_experts_start_len": None}, (
            "sglang-router's Rust balancer now forwards the routed-experts fields: engine.load_balancer: rust "
            "could be allowed with router replay (config/rollout.py)")


def test_engine_accepts_the_rust_load_balancers_neutral_fields_and_refuses_active_ones():
    forwarded = {"model": None, "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1},
                 "return_logprob": True, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                 "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                 "return_entropy": False, "rid": "a"}
    assert parse_generate(forwarded, vocab_size=64)[0].input_ids == [1, 2]
    for key, active in (("return_hidden_states", True), ("return_entropy", True), ("model", "other"),
                        ("background", True)):
        with pytest.raises(BadRequest, match=key):
            parse_generate({**forwarded, key: active}, vocab_size=64)


def test_config_check_refuses_the_rust_load_balancer_with_router_replay():
    from neon_hpc.config import ConfigError, load
    with pytest.raises(ConfigError, match="engine.load_balancer"):
        load(TINY, ["engine.kind=sglang", "engine.num_engines=2", "engine.pd_disaggregation=true",
                                       "engine.load_balancer=rust"])
    cfg = load(TINY, ["engine.kind=sglang", "engine.num_engines=2",
                                         "engine.pd_disaggregation=true", "engine.load_balancer=rust",
                                         "engine.enable_return_routed_experts=false"])
    assert cfg.engine.load_balancer == "rust"
