"""The rollout node's engine groups: chosen once, and the embedded group on real engine processes."""

from __future__ import annotations

import signal

import psutil
import pytest

from neon_hpc import config
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.rollout.engines.groups import EmbeddedEngines, ExternalEngines, SGLangEngines, engine_group


def _cfg(**sets):
    return config.load(None, [f"{k}={v}" for k, v in sets.items()])


def test_the_group_is_chosen_once_from_the_environment_and_the_config(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    monkeypatch.delenv("NEON_ENGINE_URLS", raising=False)
    assert isinstance(engine_group(_cfg(), run, 0, 1, None), EmbeddedEngines)
    assert isinstance(engine_group(_cfg(**{"engine.kind": "sglang"}), run, 0, 1, None), SGLangEngines)
    monkeypatch.setenv("NEON_ENGINE_URLS", "http://a:1,http://b:2")
    ext = engine_group(_cfg(**{"engine.kind": "sglang"}), run, 0, 3, None)    # the URLs win over the kind
    assert isinstance(ext, ExternalEngines)
    assert ext.start(0, tmp_path, lambda: False)
    assert [ext.worker_url(w) for w in range(3)] == ["http://a:1", "http://b:2", "http://a:1"]
    assert ext.worker_nodes() == [0, 1, 2] and ext.update_urls() == [] and ext.record() is None
    assert ext.dead() is None


@pytest.fixture
def weights(tmp_path):
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models import hf
    cfg = ModelConfig()
    run = RunDir(tmp_path / "run").create()
    hf.save_hf(hf.build_hf_model(cfg, seed=1), cfg, run.weights_version(0))
    return run


@pytest.mark.slow   # two engine processes load a model: 25-90 s on the shared 2-core machine
def test_embedded_group_serves_reports_a_dead_engine_and_stops_it(weights):
    cfg = _cfg(**{"engine.num_engines": 2})
    group = EmbeddedEngines(cfg, weights, node_count=1)
    try:
        assert group.start(0, weights.weights_version(0), lambda: False)
        urls = group.update_urls()
        assert len(urls) == 2 and group.version == 0
        assert [group.worker_url(w) for w in range(3)] == [urls[0], urls[1], urls[0]]
        assert group.record() == {"urls": urls, "kind": "embedded"}
        assert group.dead() is None
        victim = group.handles[1].process
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        assert group.dead() == f"embedded engine 1 at {urls[1]} exited (exit code -9)"
        alive = psutil.Process(group.handles[0].process.pid)
    finally:
        group.stop()
    assert not alive.is_running() or alive.status() == psutil.STATUS_ZOMBIE
