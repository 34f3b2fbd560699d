"""model.init_checkpoint: a neon-hpc trainer checkpoint (torch_dist + the config.json it carries for
reshard) is loaded as torch_dist, never mistaken for an HF folder; the trainer and config check agree."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from neon_hpc.train.backend import init_checkpoint_kind
from repo_paths import REPO


def test_metadata_decides_before_config_json(tmp_path):
    both = tmp_path / "step_3"
    both.mkdir()
    (both / ".metadata").write_bytes(b"x")
    (both / "config.json").write_text("{}")
    assert init_checkpoint_kind(both) == "torch_dist"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert init_checkpoint_kind(hf) == "hf"
    with pytest.raises(FileNotFoundError, match="neither a torch_dist checkpoint"):
        init_checkpoint_kind(tmp_path / "nothing")


class _Boom:
    def __reduce__(self):
        import os
        return (os.system, ("touch /tmp/neon-init-ckpt-pwned",))


def test_config_check_vets_a_trainer_checkpoint_even_with_config_json(tmp_path):
    from neon_hpc.config import load
    from neon_hpc.config_cli import _init_checkpoint
    ck = tmp_path / "step_3"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / ".metadata").write_bytes(pickle.dumps(_Boom()))
    cfg = load(str(REPO / "configs" / "tiny_cpu.yaml"), [f"model.init_checkpoint={ck}"])
    problems = _init_checkpoint(cfg)
    assert problems and "init_checkpoint" in problems[0][1]
    assert not Path("/tmp/neon-init-ckpt-pwned").exists()
