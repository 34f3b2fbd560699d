"""Where the output's ``config.json`` comes from, and whether it fits the checkpoint.

In order (the first that applies wins):

1. ``--hf-config-dir DIR`` (or ``hf_config=`` a dict, the trainer's in-process publish);
2. the checkpoint's own ``config.json`` (neon-hpc's trainer writes one into every checkpoint);
3. the run's ``run.yaml`` two levels up, when the checkpoint lives in a run directory
   (``RUN/checkpoints/step_N`` -> ``RUN/run.yaml``, its ``model`` section).

Otherwise the conversion is refused, naming the fields the checkpoint's shapes cannot tell
and these three ways.  A guessed field is never written silently: only with
``--allow-guessed-config`` (foreign checkpoints) are the shape-derived fields written, the
guesses printed and recorded in the output's ``README.md`` and index metadata.

Whatever the source, :func:`check_config_shapes` compares its shape fields with the
checkpoint's tensors before anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from neon_hpc.arch import ARCHES, ARCHITECTURES, MODEL_TYPES
from neon_hpc.arch import get as get_architecture
from neon_hpc.util.bounded import short_repr
from neon_hpc.reshard.slabs import MappingError
from neon_hpc.reshard.hfconfig import _num_layers, _shape, derive_hf_config
from neon_hpc.reshard.metadata import Checkpoint, read_json_object

CONFIG_FILE = "config.json"
from neon_hpc.protocol.rundir import RUN_YAML as RUN_CONFIG  # noqa: E402  (the run's config file)
# What the shapes of a checkpoint cannot tell (beyond what derive_hf_config lists itself).
_ALWAYS_GUESSED = ["vocab_size (real, unpadded)", "rope_theta", "rms_norm_eps", "num_experts_per_tok",
                   "max_position_embeddings"]
# Megatron pads the vocab to a multiple of make_vocab_size_divisible_by (128) x TP; more
# padding than this means the config's vocab_size belongs to another model.
MAX_VOCAB_PADDING = 128 * 8


@dataclass
class ConfigSource:
    cfg: dict
    origin: str                          # where it came from, for messages and the output README
    tokenizer_dir: Path | None = None    # tokenizer files next to the config are copied from here
    guessed: list[str] = field(default_factory=list)


def ways_to_supply(ckpt_path: Path) -> str:
    return (f"Supply the model's HF config one of three ways: (1) --hf-config-dir DIR holding its config.json; "
            f"(2) a {CONFIG_FILE} inside the checkpoint ({ckpt_path / CONFIG_FILE}: neon-hpc's trainer writes one "
            f"into every checkpoint it saves); (3) the run's {RUN_CONFIG} two levels up ({_run_yaml(ckpt_path)}, "
            f"when the checkpoint lives in RUN/checkpoints/step_N). For a foreign checkpoint only, "
            f"--allow-guessed-config --arch {'|'.join(ARCHES)} writes the shape-derived fields and records "
            f"the guesses in the output's README.md.")


def _run_yaml(ckpt_path: Path) -> Path:
    return Path(ckpt_path).absolute().parent.parent / RUN_CONFIG


def hf_config_for_model(model_cfg) -> dict:
    """The HF ``config.json`` (a dict) that a ``model:`` section (a ModelConfig) implies.

    The trainer writes this into each checkpoint, and reshard derives it from a run's
    ``run.yaml``: one function (the architecture's ``hf_config_dict``, its folder's ``hfmap.py``),
    so both agree."""
    return dict(get_architecture(model_cfg.arch).hf_config_dict(model_cfg))


def _read_json(path: Path) -> dict:
    cfg = read_json_object(path, "an HF config.json", MappingError)
    if cfg is None:
        raise MappingError(f"{path} is missing")
    _check_field_types(cfg, str(path))
    return cfg


def _check_field_types(cfg: dict, where: str) -> None:
    """The fields reshard computes with are integers (``vocab_size``, the shape fields) or a
    string (``model_type``): anything else is refused naming the field, not met later as a
    TypeError deep in the task builder."""
    ints = {"vocab_size", *(k for ks in _SHAPE_FIELDS.values() for k in ks)}
    for k in sorted(ints & set(cfg)):
        v = cfg[k]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise MappingError(f"{where}: {k} is {short_repr(v)}, not a non-negative integer; the config is "
                               f"damaged or not this model's HF config.json")
    for k in ("model_type",):
        if k in cfg and cfg[k] is not None and not isinstance(cfg[k], str):
            raise MappingError(f"{where}: {k} is {short_repr(cfg[k])}, not a string")
    if "architectures" in cfg and not (isinstance(cfg["architectures"], list)
                                       and all(isinstance(a, str) for a in cfg["architectures"])):
        raise MappingError(f"{where}: architectures is {short_repr(cfg['architectures'])}, not a list of strings")


def resolve(ckpt: Checkpoint, hf_config_dir=None, hf_config: dict | None = None, arch: str | None = None,
            allow_guessed: bool = False) -> ConfigSource:
    """The config for ``ckpt`` from the first source that applies (see the module doc)."""
    if hf_config is not None:
        _check_field_types(hf_config, "hf_config (given by the caller)")
        return ConfigSource(dict(hf_config), "hf_config (given by the caller)")
    if hf_config_dir is not None:
        p = Path(hf_config_dir) / CONFIG_FILE
        if not p.is_file():
            raise MappingError(f"{p} is missing; --hf-config-dir must hold the model's HF config.json")
        return ConfigSource(_read_json(p), f"--hf-config-dir {p}", Path(hf_config_dir))
    own = ckpt.path / CONFIG_FILE
    if own.is_file():
        return ConfigSource(_read_json(own), f"the checkpoint's own {own}", ckpt.path)
    run_yaml = _run_yaml(ckpt.path)
    if ckpt.path.absolute().parent.name == "checkpoints" and run_yaml.is_file():
        from neon_hpc import config as experiment  # deferred: heavy (neon_hpc.config: h5py, numpy)
        try:
            model_cfg = experiment.load(run_yaml).model
        except experiment.ConfigError as e:
            raise MappingError(f"{run_yaml}: cannot read the run's model section for the HF config ({e}). "
                               + ways_to_supply(ckpt.path)) from e
        return ConfigSource(hf_config_for_model(model_cfg), f"the run's {run_yaml} (model section)")
    derived, guessed = _derive(ckpt, arch)
    if not allow_guessed:
        known = ", ".join(sorted(k for k, v in (derived or {}).items() if v is not None and k not in
                                 ("model_type", "architectures"))) or "none (pass --arch)"
        raise MappingError(f"{ckpt.path}: no HF config found. The checkpoint's shapes give {known}; they cannot "
                           f"give {', '.join(guessed)}. A config with those guessed would load and serve different "
                           f"logits without any error, so reshard will not write one. " + ways_to_supply(ckpt.path))
    if derived is None:
        raise MappingError(f"{ckpt.path}: --allow-guessed-config needs --arch {'|'.join(ARCHES)} to derive "
                           f"the shape fields. " + ways_to_supply(ckpt.path))
    return ConfigSource(derived, f"derived from the checkpoint's shapes (--allow-guessed-config, --arch {arch})",
                        None, guessed)


def _derive(ckpt: Checkpoint, arch: str | None) -> tuple[dict | None, list[str]]:
    if arch is None:
        return None, list(_ALWAYS_GUESSED)
    cfg, guessed = derive_hf_config(ckpt, arch)
    guessed = list(dict.fromkeys(guessed + _ALWAYS_GUESSED[1:] + list(get_architecture(arch).guessed_fields)))
    guessed = [g for g in guessed if not g.startswith("vocab_size")] + ["vocab_size (padded rows kept)"]
    return cfg, guessed


# ---------------------------------------------------------------------------------------
# config vs checkpoint shapes

# the config.json fields a checkpoint's shapes decide, per architecture: its ``shape_fields``
_SHAPE_FIELDS = {name: list(a.shape_fields) for name, a in ARCHITECTURES.items()}


def check_config_shapes(cfg: dict, ckpt: Checkpoint, arch: str | None = None) -> None:
    """Refuse a config whose shape fields disagree with the checkpoint's tensors (hidden size,
    layers, heads, experts, MLA ranks, vocab after padding), naming every mismatch."""
    resolved = arch or MODEL_TYPES.get(cfg.get("model_type") or "")
    derived: dict = {}
    if resolved in _SHAPE_FIELDS:
        try:
            derived, _ = derive_hf_config(ckpt, resolved)
        except MappingError:
            derived = {}          # shapes too unusual to derive everything: check the basics below
    emb = _shape(ckpt, "embedding.word_embeddings.weight")
    if emb is not None:
        derived.setdefault("hidden_size", emb[1])
    if (layers := _num_layers(ckpt)):
        derived.setdefault("num_hidden_layers", layers)
    bad = []
    for k in _SHAPE_FIELDS.get(resolved, ["hidden_size", "num_hidden_layers"]):
        want, have = cfg.get(k), derived.get(k)
        if want is not None and have is not None and want != have:
            bad.append(f"{k}={want} (checkpoint: {have})")
    rows = emb[0] if emb is not None else None
    vocab = cfg.get("vocab_size")
    if rows is not None and vocab is not None:
        if vocab > rows:
            bad.append(f"vocab_size={vocab} (checkpoint: {rows} embedding rows)")
        elif rows - vocab >= MAX_VOCAB_PADDING:
            bad.append(f"vocab_size={vocab} (checkpoint: {rows} embedding rows; megatron pads by fewer than "
                       f"{MAX_VOCAB_PADDING})")
    if bad:
        raise MappingError(f"the HF config does not fit checkpoint {ckpt.path}: {'; '.join(bad)}. It belongs to "
                           f"another model (or the checkpoint to another run); nothing was written.")


# ---------------------------------------------------------------------------------------
# --dst must stay out of the source


def check_dst_outside_src(src, dst) -> None:
    """Refuse a ``--dst`` equal to, inside, or containing ``--src`` (symlinks resolved)."""
    s = Path(os.path.realpath(src))
    d = Path(os.path.realpath(dst))
    if d == s or s in d.parents or d in s.parents:
        how = "is" if d == s else ("is inside" if s in d.parents else "contains")
        raise MappingError(f"--dst {dst} ({d}) {how} --src {src} ({s}); the converter never writes into or around "
                           f"the checkpoint it reads. Choose a --dst outside {s}.")
