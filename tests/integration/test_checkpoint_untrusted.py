"""A checkpoint whose pickles would run code is refused before megatron opens it.

megatron-core's torch_dist load unpickles ``.metadata`` with a plain ``pickle.load``; a file
whose ``__reduce__`` names ``os.system`` runs that command inside the trainer.  One real
megatron-core process (gloo, the tiny model) saves a real trainer checkpoint, loads it back
(the allowlist accepts what the trainer writes), then meets three tampered copies: a
malicious ``.metadata`` on resume, a malicious ``common.pt`` on resume, and a malicious
``.metadata`` as ``model.init_checkpoint``.  Each is refused and its command never runs.
The same file handed to megatron directly does run the command: the payload is live.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neon_hpc.util.netutil import free_port
from repo_paths import REPO

pytestmark = pytest.mark.slow

CHILD = r'''
import json, os, pickle, shutil, sys
from pathlib import Path
import torch
from neon_hpc.config.model import ModelConfig
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.train import backend as B, checkpoint as ckpt
from neon_hpc.checkpoint.metadata import CheckpointError

root, marker = Path(sys.argv[1]), Path(sys.argv[2])

class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

out = {}
be = B.setup(ModelConfig(), backend="gloo")
be.ddp.zero_grad_buffer()
be.optimizer.zero_grad()
be.optimizer.step()          # a trained checkpoint carries Adam state (a fresh optimizer has none)
run = RunDir(root / "run").create()
ckpt.save(run, be, 1, {"version": 1, "cursor": {"next_step": 2, "claimed_steps": [1]}})
out["real_loaded_step"] = ckpt.load(run, be, 1)["step"]

def tampered(step, what):
    d = run.checkpoint(step)
    shutil.copytree(run.checkpoint(1), d)
    st = json.loads((d / "trainer_state.json").read_text()); st["step"] = step
    (d / "trainer_state.json").write_text(json.dumps(st))
    if what == "metadata":
        (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    else:
        torch.save({"note": Evil()}, d / "common.pt")
    return d

def attempt(name, fn):
    try:
        fn()
        out[name] = "LOADED"
    except CheckpointError as e:
        out[name] = "REFUSED " + str(e)

bad_meta = tampered(2, "metadata")
attempt("resume_metadata", lambda: ckpt.load(run, be, 2))
bad_common = tampered(3, "common")
attempt("resume_common", lambda: ckpt.load(run, be, 3))
init = root / "foreign_init"
shutil.copytree(bad_meta, init)
(init / "config.json").unlink(missing_ok=True)   # a torch_dist folder, not an HF one
attempt("init_checkpoint", lambda: B.load_initial_weights(be, str(init)))
out["marker_after_refusals"] = marker.exists()

# the reproduction: megatron's own load of the same directory runs the command
from megatron.core import dist_checkpointing
try:
    dist_checkpointing.load({"model": be.model.sharded_state_dict()}, str(bad_meta))
except BaseException as e:   # DCP's CheckpointException is a BaseException
    out["megatron_error"] = type(e).__name__
out["marker_after_megatron"] = marker.exists()
print("RESULT_JSON " + json.dumps(out), flush=True)
'''


def test_malicious_checkpoint_pickles_refused(tmp_path):
    marker = tmp_path / "PWNED"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(marker)], env=env,
                       capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT_JSON ")), None)
    assert line is not None, f"child failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(line.split(" ", 1)[1])
    assert out["real_loaded_step"] == 1                     # what the trainer writes is accepted
    for name, needle in (("resume_metadata", "posix.system"), ("resume_common", "global(s) posix.system"),
                         ("init_checkpoint", "posix.system")):
        assert out[name].startswith("REFUSED "), (name, out[name])
        assert needle in out[name], (name, out[name])
        assert "\n" not in out[name], (name, out[name])      # one line: the file, the global, what to do
    assert "step_2/.metadata" in out["resume_metadata"] and "step_3/common.pt" in out["resume_common"]
    assert out["marker_after_refusals"] is False            # the command never ran
    assert out["marker_after_megatron"] is True             # ... and would have, without the check


def test_config_check_refuses_malicious_init_checkpoint(tmp_path):
    """`neon-hpc config check` runs the trainer's start-up check of model.init_checkpoint."""
    import pickle

    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    d = tmp_path / "foreign_ckpt"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "config", "check", "configs/tiny_cpu.yaml",
                        "--set", f"model.init_checkpoint={d}"], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "model.init_checkpoint" in r.stderr and "posix.system" in r.stderr, r.stderr
    assert not marker.exists()


def _evil_reduce(marker: Path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    return Evil()


def _init_dir(tmp_path: Path, what: str, marker: Path) -> tuple[Path, str, str]:
    """A model.init_checkpoint folder of kind ``what``; returns (folder, file named, what it names)."""
    import pickle

    import torch
    d = tmp_path / f"init_{what.replace(' ', '_')}"
    d.mkdir()
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    if what == "malicious .metadata":
        (d / ".metadata").write_bytes(pickle.dumps(_evil_reduce(marker)))
        return d, ".metadata", "global posix.system"
    if what == "malicious common.pt":
        from torch.distributed.checkpoint.metadata import Metadata
        (d / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
        torch.save({"note": _evil_reduce(marker)}, d / "common.pt")
        return d, "common.pt", "global(s) posix.system"
    if what == "truncated .metadata":
        from torch.distributed.checkpoint.metadata import Metadata
        (d / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}))[:20])
        return d, ".metadata", "cannot read DCP metadata"
    if what == "neither kind":
        return d, str(d), "neither a torch_dist checkpoint"
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["malicious .metadata", "malicious common.pt", "truncated .metadata", "neither kind"])
def test_the_trainer_refuses_an_untrusted_init_checkpoint_in_one_line(tmp_path, what):
    """The trainer process, as the launcher starts it: no traceback, one error line naming the
    file and what in it is refused, what to do, exit code 2, before the model is built."""
    marker = tmp_path / "PWNED"
    d, file, named = _init_dir(tmp_path, what, marker)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "neon_hpc.train", "--config", "configs/tiny_cpu.yaml",
                        "--run-dir", str(tmp_path / "run"), "--set", f"model.init_checkpoint={d}"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if " ERROR " in ln]
    assert len(errors) == 1, r.stderr[-3000:]
    line = errors[0]
    assert "model.init_checkpoint" in line and file in line and named in line, line
    assert any(w in line for w in ("Re-save", "re-save", "restore", "point it at")), line   # what to do
    assert not marker.exists()
