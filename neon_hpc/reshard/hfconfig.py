"""The HF side of the output: where its ``config.json`` comes from, whether it fits, and writing it.

In order (the first that applies wins, :func:`resolve`):

1. ``--hf-config-dir DIR`` (or ``hf_config=`` a dict, the trainer's in-process publish);
2. the checkpoint's own ``config.json`` (neon-hpc's trainer writes one into every checkpoint);
3. the run's ``run.yaml`` two levels up, when the checkpoint lives in a run directory
   (``RUN/checkpoints/step_N`` -> ``RUN/run.yaml``, its ``model`` section).

(2 and 3 are what a checkpoint carries: :mod:`neon_hpc.checkpoint.configsource`.)  Otherwise
the conversion is refused, naming the fields the checkpoint's shapes cannot tell and these
three ways.  A guessed field is never written silently: only with ``--allow-guessed-config``
(foreign checkpoints) are the shape-derived fields written (:func:`derive_hf_config`: ``--arch``
names the architecture, the shapes come from the checkpoint, fields that shapes cannot tell take
the HF defaults), the guesses printed and recorded in the output's ``README.md`` and index
metadata.

Whatever the source, :func:`check_config_shapes` compares its shape fields with the
checkpoint's tensors before anything is written.  With ``--hf-config-dir`` its tokenizer files
are copied too (:func:`write_hf_side`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from neon_hpc.arch import ARCHES, MODEL_TYPES, ShapeError, get as get_architecture
from neon_hpc.checkpoint.configsource import (
    CONFIG_FILE,
    RUN_CONFIG,
    SHAPE_FIELDS,
    check_field_types,
    hf_config_for_model,
    read_config_json,
    run_yaml,
)
from neon_hpc.checkpoint.metadata import Checkpoint
from neon_hpc.reshard.slabs import MappingError

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
            f"into every checkpoint it saves); (3) the run's {RUN_CONFIG} two levels up ({run_yaml(ckpt_path)}, "
            f"when the checkpoint lives in RUN/checkpoints/step_N). For a foreign checkpoint only, "
            f"--allow-guessed-config --arch {'|'.join(ARCHES)} writes the shape-derived fields and records "
            f"the guesses in the output's README.md.")


def resolve(ckpt: Checkpoint, hf_config_dir=None, hf_config: dict | None = None, arch: str | None = None,
            allow_guessed: bool = False) -> ConfigSource:
    """The config for ``ckpt`` from the first source that applies (see the module doc)."""
    if hf_config is not None:
        check_field_types(hf_config, "hf_config (given by the caller)", MappingError)
        return ConfigSource(dict(hf_config), "hf_config (given by the caller)")
    if hf_config_dir is not None:
        p = Path(hf_config_dir) / CONFIG_FILE
        if not p.is_file():
            raise MappingError(f"{p} is missing; --hf-config-dir must hold the model's HF config.json")
        return ConfigSource(read_config_json(p, MappingError), f"--hf-config-dir {p}", Path(hf_config_dir))
    own = ckpt.path / CONFIG_FILE
    if own.is_file():
        return ConfigSource(read_config_json(own, MappingError), f"the checkpoint's own {own}", ckpt.path)
    run_config = run_yaml(ckpt.path)
    if ckpt.path.absolute().parent.name == "checkpoints" and run_config.is_file():
        from neon_hpc import config as experiment  # deferred: heavy (neon_hpc.config: h5py, numpy)
        try:
            model_cfg = experiment.load(run_config).model
        except experiment.ConfigError as e:
            raise MappingError(f"{run_config}: cannot read the run's model section for the HF config ({e}). "
                               + ways_to_supply(ckpt.path)) from e
        return ConfigSource(hf_config_for_model(model_cfg), f"the run's {run_config} (model section)")
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


def check_config_shapes(cfg: dict, ckpt: Checkpoint, arch: str | None = None) -> None:
    """Refuse a config whose shape fields disagree with the checkpoint's tensors (hidden size,
    layers, heads, experts, MLA ranks, vocab after padding), naming every mismatch."""
    resolved = arch or MODEL_TYPES.get(cfg.get("model_type") or "")
    derived: dict = {}
    if resolved in SHAPE_FIELDS:
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
    for k in SHAPE_FIELDS.get(resolved, ["hidden_size", "num_hidden_layers"]):
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "added_tokens.json", "chat_template.jinja",
                   "tiktoken.model")


def _shape(ckpt: Checkpoint, *keys: str):
    for k in keys:
        if k in ckpt.tensors:
            return ckpt.tensors[k].shape
    return None


def _layer_key_shape(ckpt: Checkpoint, suffix: str):
    """Shape of a decoder-layer weight without its layer axis (stacked or per-layer)."""
    if (s := _shape(ckpt, f"decoder.layers.{suffix}")) is not None:
        return s[1:]
    for key, tm in sorted(ckpt.tensors.items()):
        if key.startswith("decoder.layers.") and key.endswith("." + suffix) and key.split(".")[2].isdigit():
            return tm.shape
    return None


def _num_layers(ckpt: Checkpoint) -> int:
    layers = set()
    for key, tm in ckpt.tensors.items():
        parts = key.split(".")
        if key.startswith("decoder.layers.") and parts[2].isdigit():
            layers.add(int(parts[2]))
        elif key.startswith("decoder.layers."):
            layers.update(range(tm.shape[0]))
    return len(layers)


def derive_hf_config(ckpt: Checkpoint, arch: str) -> tuple[dict, list[str]]:
    """A config.json from the checkpoint's shapes; returns it and the fields that were guessed.

    The shapes give model fields (:class:`~neon_hpc.config.model.ModelConfig`'s names); their
    HF names, and what the architecture fixes, are the architecture's (``hf_fields``, its folder's ``hfmap.py``),
    the same table the trainer's ``config.json`` is written from."""
    try:
        facts = get_architecture(arch)
    except ValueError as e:
        raise MappingError(str(e)) from None
    emb = _shape(ckpt, "embedding.word_embeddings.weight")
    if emb is None:
        raise MappingError(f"{ckpt.path}: no embedding.word_embeddings.weight; cannot derive an HF config; "
                           f"pass --hf-config-dir")
    vocab, hidden = emb
    fc1 = _layer_key_shape(ckpt, "mlp.experts.experts.linear_fc1.weight")
    proj = _layer_key_shape(ckpt, "self_attention.linear_proj.weight")
    fields = {"vocab_size": vocab, "hidden_size": hidden, "num_layers": _num_layers(ckpt)}
    guessed = ["vocab_size (padded rows kept)", "rope_theta", "rms_norm_eps", "num_experts_per_tok",
               "max_position_embeddings"]
    if fc1 is not None:
        fields["moe_ffn_hidden_size"] = fc1[-2] // 2
    try:
        fields.update(facts.fields_from_shapes(_CheckpointShapes(ckpt), proj, fc1))
    except ShapeError as e:
        raise MappingError(f"{ckpt.path}: {e}; pass --hf-config-dir") from None
    guessed += list(facts.derive_guessed)
    cfg = facts.hf_fields(fields)
    cfg["tie_word_embeddings"] = "output_layer.weight" not in ckpt.tensors
    return cfg, guessed


class _CheckpointShapes:
    """A checkpoint's shapes as an architecture's ``fields_from_shapes`` asks for them
    (:class:`neon_hpc.arch.Shapes`)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def layer(self, suffix: str):
        return _layer_key_shape(self.ckpt, suffix)

    def tensor(self, key: str):
        return _shape(self.ckpt, key)

    def dense_layers(self) -> list[int]:
        return sorted(int(k.split(".")[2]) for k in self.ckpt.tensors if k.startswith("decoder.layers.")
                      and k.endswith(".mlp.linear_fc1.weight") and k.split(".")[2].isdigit())


def write_hf_side(dst: Path, cfg: dict, hf_config_dir: str | Path | None) -> list[str]:
    """Write config.json and copy tokenizer files into ``dst``; returns the names written."""
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    names = ["config.json"]
    if hf_config_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(hf_config_dir) / name
            if src.is_file():
                shutil.copyfile(src, dst / name)
                names.append(name)
    return names
