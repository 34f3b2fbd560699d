"""Reshard on a real trainer checkpoint (issue 21): the checkpoint carries its own HF config
and blob digests, so it converts with no --hf-config-dir and transformers' logits equal the
megatron-core model's; every way of supplying the config, and the refusal; a config that does
not fit refused before output; flipped bytes refused naming the tensor (reshard and resume);
``--dst`` inside the source refused.

One subprocess builds the tiny Qwen3-MoE with the trainer's own ``backend.setup`` (megatron-core
over gloo, world 1), adds seeded noise to every weight (norms away from 1), records its logits,
takes one optimizer step, saves with ``train.checkpoint.save`` into a real run directory, and then resumes it with
``train.checkpoint.load`` three times: intact, with flipped bytes in a blob, and with a
tampered ``param_digest_rank0``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from neon_hpc.reshard import convert
from neon_hpc.reshard.pipeline import ReshardError
from neon_hpc.util.netutil import free_port
from repo_paths import REPO

TOL = 1e-4

PROG = r"""
import json, shutil, sys
from pathlib import Path
import numpy as np
import torch
from neon_hpc import config
from neon_hpc.models import megatron
from neon_hpc.config.model import ModelConfig
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.train import backend as B, checkpoint as ckpt

root = Path(sys.argv[1])
cfg = config.load(None)
be = B.setup(cfg.model, seed=1, replay=False)
g = torch.Generator().manual_seed(7)
with torch.no_grad():
    for p in be.model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, size=(2, 8))
# one optimizer step (a trainer checkpoint carries optimizer state, which its resume expects)
from megatron.core.distributed import finalize_model_grads
be.ddp.zero_grad_buffer(); be.optimizer.zero_grad()
megatron.forward_logits(be.ddp, torch.from_numpy(ids)).float().pow(2).mean().backward()
finalize_model_grads([be.ddp])
be.optimizer.step()
be.model.eval()
with torch.no_grad():
    logits = megatron.forward_logits(be.model, torch.from_numpy(ids))
np.save(root / "ids.npy", ids)
np.save(root / "logits.npy", logits.float().numpy())
run = RunDir(root / "run").create()
run.run_yaml.write_text(config.dump(cfg))
ckpt.save(run, be, 1, {"version": 1})

def resume(run_root):
    try:
        st = ckpt.load(RunDir(run_root), be, 1)
        return {"ok": True, "digests_verified": st["digests_verified"],
                "param_digest_checked": st["param_digest_checked"]}
    except BaseException as e:
        return {"ok": False, "type": type(e).__name__, "error": str(e)[:2000]}

out = {"intact": resume(root / "run")}
# flipped bytes in the middle of the first routed-expert fc1 blob
from neon_hpc.checkpoint.metadata import read_checkpoint
ck = read_checkpoint(root / "run" / "checkpoints" / "step_1")
key = sorted(k for k in ck.tensors if k.startswith("decoder.") and "experts" in k and "linear_fc1.weight" in k)[0]
c = ck.tensors[key].chunks[0]
out["target"] = [c.file, c.offset + c.length // 2, f"{key}@{list(c.offsets)}"]
bad = root / "bad_blob"
shutil.copytree(root / "run", bad)
with open(bad / "checkpoints" / "step_1" / c.file, "r+b") as h:
    h.seek(out["target"][1]); b = h.read(64); h.seek(out["target"][1]); h.write(bytes(x ^ 0xFF for x in b))
out["bad_blob"] = resume(bad)
# a tampered param digest (as if the loaded weights were not the saved ones)
tam = root / "bad_digest"
shutil.copytree(root / "run", tam)
sf = tam / "checkpoints" / "step_1" / "trainer_state.json"
st = json.loads(sf.read_text()); st["param_digest_rank0"] *= 1.001; sf.write_text(json.dumps(st))
out["bad_digest"] = resume(tam)
print("RESUME " + json.dumps(out), flush=True)
B.teardown()
"""


def _run_prog(root: Path) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", PROG, str(root)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESUME "))
    return json.loads(line[len("RESUME "):])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run directory with checkpoints/step_1, and the three resume outcomes."""
    root = tmp_path_factory.mktemp("trainer_ckpt")
    res = _run_prog(root)
    return {"root": root, "step": root / "run" / "checkpoints" / "step_1", "resume": res,
            "target": tuple(res["target"])}


@pytest.mark.slow
def test_trainer_checkpoint_carries_hf_config_and_digests(trained):
    from neon_hpc.checkpoint.configsource import hf_config_for_model
    from neon_hpc.config.model import ModelConfig
    step = trained["step"]
    assert json.loads((step / "config.json").read_text()) == json.loads(json.dumps(hf_config_for_model(ModelConfig())))
    body = json.loads((step / "integrity.json").read_text())
    distcp = sorted(p.name for p in step.glob("*.distcp"))
    assert distcp and sorted(body["files"]) == distcp
    for name in distcp:     # the whole-file digest is the file's, independently recomputed
        assert body["files"][name]["digest"] == xxhash.xxh3_64((step / name).read_bytes()).hexdigest()
        assert body["files"][name]["size"] == (step / name).stat().st_size


@pytest.mark.slow
def test_round_trip_without_hf_config_dir_gives_megatron_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM
    stats = convert(trained["step"], tmp_path / "hf")
    assert stats["config_source"].startswith("the checkpoint's own") and stats["digests_verified"]
    assert stats["digest_reread_bytes"] == 0
    assert stats["guessed_config_fields"] == [] and not (tmp_path / "hf" / "README.md").exists()
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    ids = np.load(trained["root"] / "ids.npy")
    ref = np.load(trained["root"] / "logits.npy")
    with torch.no_grad():
        got = model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    err = float(np.abs(got - ref).max())
    assert err < TOL, f"max |logits_hf - logits_megatron| = {err}"
    assert float(np.abs(ref).max()) > 0.1
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["max_position_embeddings"] == 2048


def _copy_step(trained, dest: Path, keep_config: bool) -> Path:
    shutil.copytree(trained["step"], dest)
    if not keep_config:
        (dest / "config.json").unlink()
    return dest


@pytest.mark.slow
def test_each_way_of_supplying_the_config_and_the_refusal(trained, tmp_path):
    own = json.loads((trained["step"] / "config.json").read_text())
    # 1. --hf-config-dir wins over the checkpoint's own (which is then ignored)
    hf_dir = tmp_path / "given"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(own))
    (hf_dir / "tokenizer.json").write_text("{}")
    s1 = convert(trained["step"], tmp_path / "o1", hf_config_dir=hf_dir)
    assert s1["config_source"].startswith("--hf-config-dir") and (tmp_path / "o1" / "tokenizer.json").exists()
    # 2. the checkpoint's own config.json
    s2 = convert(trained["step"], tmp_path / "o2")
    assert s2["config_source"].startswith("the checkpoint's own")
    # 3. the run's run.yaml two levels up (a checkpoint saved before config.json existed)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copyfile(trained["root"] / "run" / "run.yaml", run / "run.yaml")
    old = _copy_step(trained, run / "checkpoints" / "step_1", keep_config=False)
    s3 = convert(old, tmp_path / "o3")
    assert s3["config_source"].startswith("the run's") and "run.yaml" in s3["config_source"]
    assert json.loads((tmp_path / "o3" / "config.json").read_text()) == own
    # none applies: refused (CLI), naming what shapes cannot tell and the three ways
    lone = _copy_step(trained, tmp_path / "lone" / "step_1", keep_config=False)
    r = subprocess.run([sys.executable, str(REPO / "tools" / "reshard.py"), "--src", str(lone), "--dst",
                        str(tmp_path / "o4"), "--arch", "qwen3_moe"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 1, r.stderr
    for needle in ("no HF config found", "rope_theta", "rms_norm_eps", "num_experts_per_tok",
                   "max_position_embeddings", "intermediate_size", "--hf-config-dir", "config.json", "run.yaml",
                   "--allow-guessed-config"):
        assert needle in r.stderr, needle
    assert not (tmp_path / "o4").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".o4")] == []


@pytest.mark.slow
@pytest.mark.parametrize("field,value", [("hidden_size", 96), ("num_attention_heads", 8), ("num_experts", 8),
                                         ("num_hidden_layers", 3), ("vocab_size", 4096), ("head_dim", 32)])
def test_a_config_that_does_not_fit_is_refused_before_any_output(trained, tmp_path, field, value):
    cfg = json.loads((trained["step"] / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "out").mkdir()
    with pytest.raises(Exception, match=rf"does not fit checkpoint.*{field}={value}"):
        convert(trained["step"], tmp_path / "out" / "hf", hf_config_dir=tmp_path / "cfg")
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_flipped_bytes_in_a_trainer_checkpoint_are_refused_by_reshard_and_resume(trained, tmp_path):
    f, off, what = trained["target"]
    src = _copy_step(trained, tmp_path / "ckpt", keep_config=True)
    with open(src / f, "r+b") as h:
        h.seek(off)
        b = h.read(64)
        h.seek(off)
        h.write(bytes(x ^ 0xFF for x in b))
    (tmp_path / "out").mkdir()
    with pytest.raises(ReshardError, match=re.escape(f) + r".*holding " + re.escape(what) + " is corrupt"):
        convert(src, tmp_path / "out" / "hf")
    assert list((tmp_path / "out").iterdir()) == []
    # the trainer's resume: intact loads with both checks; flipped bytes and a wrong param digest refuse
    assert trained["resume"]["intact"] == {"ok": True, "digests_verified": True, "param_digest_checked": True}
    bad = trained["resume"]["bad_blob"]
    assert not bad["ok"] and bad["type"] == "IntegrityError" and f in bad["error"] and "is corrupt" in bad["error"], bad
    assert what.split("@")[0] in bad["error"], bad
    tam = trained["resume"]["bad_digest"]
    assert not tam["ok"] and "param_digest_rank0" in tam["error"], tam


@pytest.mark.slow
def test_dst_inside_or_around_the_source_is_refused(trained, tmp_path):
    src = _copy_step(trained, tmp_path / "ckpt", keep_config=True)
    link = tmp_path / "link"
    link.symlink_to(src)
    before = sorted(p.name for p in src.iterdir())
    for dst in (src / "hf_out", src / "a" / "b", link / "hf_out", src, tmp_path):
        with pytest.raises(Exception, match="never writes into or around"):
            convert(link if dst.is_relative_to(link) else src, dst)
    r = subprocess.run([sys.executable, str(REPO / "tools" / "reshard.py"), "--src", str(link), "--dst",
                        str(src / "hf_out")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 1 and "is inside --src" in r.stderr, r.stderr
    assert sorted(p.name for p in src.iterdir()) == before
    assert not (tmp_path / "hf_out").exists()
