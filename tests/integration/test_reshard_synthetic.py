"""Fast path vs serial path, MPI ranks, and failure modes on a real torch_dist checkpoint.

The checkpoint is saved once per session (with the other reshard fixtures, see
``tests/reshard_fixtures.py``) by megatron-core's ``dist_checkpointing.save`` from two gloo processes
(Megatron layout: stacked layers, per-expert gate/up chunks split for TP=2, vocab padded 250 -> 256, bf16
weights, fp32 router, fp32 optimizer state alongside).
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
from safetensors import safe_open

from neon_hpc.reshard import convert
from neon_hpc.reshard.cli import main
from neon_hpc.reshard.pipeline import ReshardError, build_tasks
from neon_hpc.reshard.serial import materialize
from repo_paths import REPO
from reshard_fixtures import shared

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """fixtures.small_synth_spec(): layers 2, experts 4, hidden 32, moe_ffn 16, 4 heads / 2 groups x 8."""
    return shared(tmp_path_factory) / "synth"


@pytest.fixture(scope="module")
def serial_out(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("serial") / "hf"
    convert(ckpt / "ckpt", out, hf_config_dir=ckpt / "hf", mode="serial")
    return out


def read_all(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for name, f in index["weight_map"].items():
        with safe_open(str(d / f), "pt") as h:
            out[name] = h.get_tensor(name)
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = read_all(a), read_all(b)
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and ta[n].shape == tb[n].shape, n
        assert torch.equal(ta[n].view(torch.uint8), tb[n].view(torch.uint8)), n


def run_cli(*args: str, n: int = 0) -> subprocess.CompletedProcess:
    cmd = ([MPIEXEC, "-n", str(n)] if n else []) + [PY, str(REPO / "tools" / "reshard.py"), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_fast_path_equals_serial_byte_for_byte_in_process(ckpt, serial_out, tmp_path, ranks):
    threads = torch.get_num_threads()
    stats = convert(ckpt / "ckpt", tmp_path / "hf", hf_config_dir=ckpt / "hf", ranks=ranks)
    assert torch.get_num_threads() == threads          # an in-process caller keeps its setting
    assert stats["ranks"] == ranks and stats["files"] == ranks
    assert stats["digests_verified"] and stats["digest_reread_bytes"] == 0   # checked without a second read
    assert_same_tensors(tmp_path / "hf", serial_out)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_fast_path_over_mpi_equals_serial(ckpt, serial_out, tmp_path, n):
    r = run_cli("--src", str(ckpt / "ckpt"), "--dst", str(tmp_path / "hf"), "--hf-config-dir", str(ckpt / "hf"),
                "--quiet", "--json", n=n)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["processes"] == n and stats["ranks"] == n and len(stats["peak_rss_bytes_per_process"]) == n
    assert_same_tensors(tmp_path / "hf", serial_out)


def test_outputs_match_independent_expectations(ckpt, serial_out):
    """Rules checked against the global tensors read by torch's own DCP loader."""
    work, _, _ = build_tasks(ckpt / "ckpt", ckpt / "hf")
    full = materialize(work)
    out = read_all(serial_out)
    emb = full["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 256 and torch.equal(out["model.embed_tokens.weight"], emb[:250])
    qkv = full["decoder.layers.self_attention.linear_qkv.weight"][1].float().numpy()  # [2 groups*(2q+k+v)*8, H]
    groups = qkv.reshape(2, 4, 8, -1)
    np.testing.assert_array_equal(out["model.layers.1.self_attn.k_proj.weight"].float().numpy(),
                                  groups[:, 2].reshape(16, -1))
    np.testing.assert_array_equal(out["model.layers.1.self_attn.q_proj.weight"].float().numpy(),
                                  groups[:, :2].reshape(32, -1))
    fc1 = full["decoder.layers.mlp.experts.experts.linear_fc1.weight"][0, 3]
    assert torch.equal(out["model.layers.0.mlp.experts.3.gate_proj.weight"], fc1[:16])
    assert torch.equal(out["model.layers.0.mlp.experts.3.up_proj.weight"], fc1[16:])
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.float32   # dtype never changes
    assert not any("optimizer" in n for n in out)


def test_output_directory_has_config_tokenizer_and_index(ckpt, tmp_path):
    stats = convert(ckpt / "ckpt", tmp_path / "hf", hf_config_dir=ckpt / "hf", verify=0)
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
                     "tokenizer.json"]
    assert stats["verified"]["tensors_compared"] == stats["tensors"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in read_all(tmp_path / "hf").values())
    with pytest.raises(ReshardError, match="already exists"):
        convert(ckpt / "ckpt", tmp_path / "hf", hf_config_dir=ckpt / "hf")


def _broken_copy(ckpt: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt / "ckpt", dst)
    return dst


def _assert_nothing_written(out_parent: Path) -> None:
    assert [p.name for p in out_parent.iterdir()] == [], "no output and no staging folder may remain"


def test_truncated_distcp_is_a_clear_error_and_leaves_nothing(ckpt, tmp_path):
    src = _broken_copy(ckpt, tmp_path)
    victim = src / "__1_1.distcp"
    os.truncate(victim, victim.stat().st_size // 2)
    (tmp_path / "out").mkdir()
    r = run_cli("--src", str(src), "--dst", str(tmp_path / "out" / "hf"), "--hf-config-dir", str(ckpt / "hf"))
    assert r.returncode == 1 and "__1_1.distcp is truncated" in r.stderr
    _assert_nothing_written(tmp_path / "out")


def test_missing_distcp_is_a_clear_error_and_leaves_nothing(ckpt, tmp_path):
    src = _broken_copy(ckpt, tmp_path)
    (src / "__0_1.distcp").unlink()
    (tmp_path / "out").mkdir()
    with pytest.raises(Exception, match=r"__0_1.distcp is missing"):
        convert(src, tmp_path / "out" / "hf", hf_config_dir=ckpt / "hf")
    _assert_nothing_written(tmp_path / "out")


def test_foreign_pickle_is_refused_and_leaves_nothing(ckpt, tmp_path):
    src = _broken_copy(ckpt, tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x8c\x06system\x93.")
    (tmp_path / "out").mkdir()
    r = run_cli("--src", str(src), "--dst", str(tmp_path / "out" / "hf"), "--hf-config-dir", str(ckpt / "hf"))
    assert r.returncode == 1 and "refuses to unpickle global posix.system" in r.stderr
    _assert_nothing_written(tmp_path / "out")


def test_corrupt_chunk_found_while_reading_removes_staging(ckpt, tmp_path, capsys):
    """Without digests (integrity.json removed, converted with --allow-unverified), damage that
    breaks the blob's zip fails the run and removes staging; the run warned that integrity could
    not be verified."""
    src = _broken_copy(ckpt, tmp_path)
    (src / "integrity.json").unlink()
    work, _, _ = build_tasks(src, ckpt / "hf")
    _key, chunk = work.tasks[-1].chunks[0]
    with open(src / chunk.file, "r+b") as f:   # wipe the blob's zip directory (its last bytes)
        f.seek(chunk.offset + chunk.length - 64)
        f.write(b"\0" * 64)
    (tmp_path / "out").mkdir()
    with pytest.raises(ReshardError, match="not a loadable torch.save blob"):
        convert(src, tmp_path / "out" / "hf", hf_config_dir=ckpt / "hf", ranks=2, allow_unverified=True)
    _assert_nothing_written(tmp_path / "out")
    assert "integrity of its tensor bytes cannot be verified" in capsys.readouterr().err


def test_a_checkpoint_without_digests_is_refused_unless_allowed_and_the_output_says_so(ckpt, tmp_path, capsys):
    src = _broken_copy(ckpt, tmp_path)
    (src / "integrity.json").unlink()
    (tmp_path / "out").mkdir()
    rc = main(["--src", str(src), "--dst", str(tmp_path / "out" / "hf"), "--hf-config-dir", str(ckpt / "hf"),
               "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("reshard: error: ") and "has no integrity.json" in err, err
    assert "--allow-unverified" in err and err.count("\n") == 1
    _assert_nothing_written(tmp_path / "out")
    stats = convert(src, tmp_path / "out" / "hf", hf_config_dir=ckpt / "hf", allow_unverified=True)
    assert stats["digests_verified"] is False
    index = json.loads((tmp_path / "out" / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["integrity"] == "not verified: --allow-unverified (the checkpoint has no integrity.json)"
    verified = convert(ckpt / "ckpt", tmp_path / "ok", hf_config_dir=ckpt / "hf")
    assert verified["digests_verified"]
    index = json.loads((tmp_path / "ok" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["integrity"] == "verified"


# ---------------------------------------------------------------------------------------
# every input file, every kind of damage: one `reshard: error:` line naming the file, rc 1,
# no output (or, for the files reshard does not need, a normal conversion)

def _flip_middle(path: Path, at: int | None = None) -> None:
    """64 bytes XOR 0xFF (in a text file: invalid UTF-8) at ``at`` (default the middle)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    n = min(64, len(data) - at)
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    path.write_bytes(bytes(data))


def _wrong_shape(path: Path) -> None:
    """Valid syntax, wrong content: what each file's own parser must catch."""
    if path.name == "metadata.json":
        path.write_text("[1]")
    elif path.name == "integrity.json":
        body = json.loads(path.read_text())
        name = sorted(body["files"])[0]
        body["files"][name]["items"] = {k: 7 for k in body["files"][name]["items"]}
        path.write_text(json.dumps(body))
    elif path.name == "config.json":
        path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_size": "32"}))
    elif path.name == ".metadata":   # a valid DCP pickle whose first chunk overruns its tensor
        import pickle
        meta = pickle.loads(path.read_bytes())   # the fixture's own file: trusted here
        md = next(v for v in meta.state_dict_metadata.values() if hasattr(v, "chunks"))
        md.chunks[0].sizes = torch.Size([d + 5 for d in md.chunks[0].sizes])
        path.write_bytes(pickle.dumps(meta))
    else:
        raise AssertionError(path)


DAMAGE = {
    "flipped": _flip_middle,
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "empty": lambda p: os.truncate(p, 0),
    "deleted": lambda p: p.unlink(),
    "wrong shape": _wrong_shape,
}
# per file: the damage it is checked for, and the files reshard does not read (converts unchanged)
FILES = {"metadata.json": DAMAGE, ".metadata": DAMAGE, "integrity.json": DAMAGE, "hf/config.json": DAMAGE,
         "__0_0.distcp": {k: v for k, v in DAMAGE.items() if k != "wrong shape"},
         "__0_1.distcp": {k: v for k, v in DAMAGE.items() if k != "wrong shape"},
         "__1_0.distcp": {k: v for k, v in DAMAGE.items() if k != "wrong shape"},
         "__1_1.distcp": {k: v for k, v in DAMAGE.items() if k != "wrong shape"},
         "common.pt": {k: v for k, v in DAMAGE.items() if k != "wrong shape"}}
NOT_READ = {"common.pt"}                                  # megatron's non-sharded state: not needed for weights
STILL_VALID = {("metadata.json", "deleted")}               # a plain DCP checkpoint has no megatron marker
CASES = [(f, d) for f, ds in FILES.items() for d in ds]


def test_the_matrix_covers_every_file_of_the_checkpoint(ckpt):
    assert sorted(f for f in FILES if f != "hf/config.json") == sorted(p.name for p in (ckpt / "ckpt").iterdir())


@pytest.mark.parametrize("file,damage", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_damage_to_any_input_file_is_one_error_line_naming_it(ckpt, tmp_path, capsys, file, damage):
    src = tmp_path / "src"
    shutil.copytree(ckpt, src, ignore=shutil.ignore_patterns("hf_out*"))
    victim = src / file if file.startswith("hf/") else src / "ckpt" / file
    if victim.suffix == ".distcp" and damage == "flipped":   # inside a blob reshard reads (not optimizer state)
        work, _, _ = build_tasks(src / "ckpt", src / "hf")
        chunk = next(c for t in work.tasks for _, c in t.chunks if c.file == file)
        _flip_middle(victim, chunk.offset + chunk.length // 2)
    else:
        DAMAGE[damage](victim)
    out = tmp_path / "out"
    out.mkdir()
    rc = main(["--src", str(src / "ckpt"), "--dst", str(out / "hf"), "--hf-config-dir", str(src / "hf"), "--quiet"])
    err = capsys.readouterr().err
    if file in NOT_READ or (file, damage) in STILL_VALID:
        assert rc == 0, err
        assert (out / "hf" / "model.safetensors.index.json").exists()
        return
    assert rc == 1, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("reshard: error: "), err
    assert Path(file).name in lines[0], err
    _assert_nothing_written(out)


@pytest.mark.parametrize("damage", ["flipped", "not YAML", "wrong shape"])
def test_a_damaged_run_yaml_as_the_config_source_is_one_error_line_naming_it(ckpt, tmp_path, capsys, damage):
    """A checkpoint inside a run takes its config from RUN/run.yaml (the third source)."""
    from neon_hpc import config as experiment
    run = tmp_path / "run"
    shutil.copytree(ckpt / "ckpt", run / "checkpoints" / "step_1")
    run_yaml = run / "run.yaml"
    run_yaml.write_text(experiment.dump(experiment.load(None)))
    if damage == "flipped":
        _flip_middle(run_yaml)
    elif damage == "not YAML":
        run_yaml.write_text("model: [unclosed\n")
    else:
        run_yaml.write_text("model: 5\n")
    (tmp_path / "out").mkdir()
    rc = main(["--src", str(run / "checkpoints" / "step_1"), "--dst", str(tmp_path / "out" / "hf"), "--quiet"])
    lines = capsys.readouterr().err.splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("reshard: error: ") and "run.yaml" in lines[0], lines
    _assert_nothing_written(tmp_path / "out")


def test_a_damaged_marker_through_the_tool_is_an_error_line_not_a_traceback(ckpt, tmp_path):
    """The issue's repro, as an operator runs it: 64 flipped bytes (invalid UTF-8) in metadata.json."""
    src = _broken_copy(ckpt, tmp_path)
    _flip_middle(src / "metadata.json")
    (tmp_path / "out").mkdir()
    r = run_cli("--src", str(src), "--dst", str(tmp_path / "out" / "hf"), "--hf-config-dir", str(ckpt / "hf"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("reshard: error: ") and "metadata.json" in r.stderr and "not UTF-8" in r.stderr
    _assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("mode", ["fast", "serial"])
def test_flipped_bytes_inside_a_blob_are_refused_naming_the_tensor(ckpt, tmp_path, mode):
    """64 bytes flipped mid-blob still load as a tensor; the digest check refuses them."""
    src = _broken_copy(ckpt, tmp_path)
    work, _, _ = build_tasks(src, ckpt / "hf")
    key, chunk = next((k, c) for t in work.tasks for k, c in t.chunks if "experts.linear_fc1" in k)
    with open(src / chunk.file, "r+b") as f:
        f.seek(chunk.offset + chunk.length // 2)
        data = f.read(64)
        f.seek(chunk.offset + chunk.length // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    (tmp_path / "out").mkdir()
    with pytest.raises(ReshardError, match=re.escape(chunk.file) + r".*holding " +
                       re.escape(f"{key}@{list(chunk.offsets)}") + " is corrupt"):
        convert(src, tmp_path / "out" / "hf", hf_config_dir=ckpt / "hf", mode=mode)
    _assert_nothing_written(tmp_path / "out")
    stats = convert(src, tmp_path / "out" / "hf", hf_config_dir=ckpt / "hf", verify_digests=False)
    assert stats["digests_verified"] is False     # the flip really does pass unnoticed without the check


def test_dry_run_reads_metadata_only_and_never_imports_torch(ckpt):
    code = ("import sys; from neon_hpc.reshard.cli import main; "
            f"rc = main(['--src', {str(ckpt / 'ckpt')!r}, '--hf-config-dir', {str(ckpt / 'hf')!r}, '--dry-run', "
            "'--ranks', '2', '--tasks', '-1']); assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "over 2 rank(s)" in r.stdout and "linear_fc1.weight@[1, 3, 24, 0]" in r.stdout
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in r.stdout


def test_without_any_config_it_refuses_unless_guesses_are_allowed(ckpt, tmp_path):
    with pytest.raises(Exception, match=r"(?s)no HF config found.*rope_theta.*--hf-config-dir.*config.json.*"
                                        r"run.yaml") as e:
        convert(ckpt / "ckpt", tmp_path / "hf", arch="qwen3_moe")
    assert "rms_norm_eps" in str(e.value) and not (tmp_path / "hf").exists()
    stats = convert(ckpt / "ckpt", tmp_path / "hf", arch="qwen3_moe", allow_guessed_config=True)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 8)
    assert cfg["num_experts"] == 4 and cfg["num_hidden_layers"] == 2
    assert "rope_theta" in stats["guessed_config_fields"] and "rope_theta" not in cfg
    assert "- rope_theta" in (tmp_path / "hf" / "README.md").read_text()
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "rope_theta" in index["metadata"]["guessed_config_fields"]


@pytest.mark.slow
def test_a_failing_rank_under_mpi_fails_all_and_leaves_nothing(ckpt, tmp_path):
    src = _broken_copy(ckpt, tmp_path)
    work, _, _ = build_tasks(src, ckpt / "hf", ranks=2)
    _key, chunk = work.tasks_of(1)[0].chunks[0]          # damage only what rank 1 reads
    with open(src / chunk.file, "r+b") as f:
        f.seek(chunk.offset + chunk.length - 64)
        f.write(b"\0" * 64)
    (tmp_path / "out").mkdir()
    r = run_cli("--src", str(src), "--dst", str(tmp_path / "out" / "hf"), "--hf-config-dir", str(ckpt / "hf"),
                "--quiet", n=2)
    assert r.returncode != 0 and "is corrupt" in r.stderr and chunk.file in r.stderr
    _assert_nothing_written(tmp_path / "out")


def test_neon_hpc_cli_dispatches_reshard():
    r = subprocess.run([PY, "-m", "neon_hpc.cli", "reshard", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "--hf-config-dir" in r.stdout
