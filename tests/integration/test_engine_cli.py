"""``neon-hpc engine serve`` as a real process: serves, stops cleanly on SIGTERM."""
import signal
import subprocess
import sys

import pytest

from neon_hpc.config.model import ModelConfig
from neon_hpc.models import hf
from neon_hpc.rollout.engines.client import EngineClient


def _serve(path):
    proc = subprocess.Popen([sys.executable, "-m", "neon_hpc.cli", "engine", "serve", "--model", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("LISTENING http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
    return proc, line.split()[1]


def test_serve_answers_then_stops_cleanly_on_sigterm(tmp_path):
    cfg = ModelConfig()
    hf.save_hf(hf.build_hf_model(cfg), cfg, tmp_path / "v_3")
    proc, url = _serve(tmp_path / "v_3")
    try:
        client = EngineClient(url, timeout=60)
        assert client.health()
        res = client.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 2})
        assert res.weight_version == "3"  # taken from the v_N folder name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not client.health(timeout=2)
        with pytest.raises(ConnectionError):  # what a worker sees when its engine is gone
            client.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 2})
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_without_weights_says_where_to_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "engine", "serve", "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "config.json not found" in out.stderr
