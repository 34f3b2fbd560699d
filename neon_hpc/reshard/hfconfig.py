"""The HF side: ``config.json`` and tokenizer files for the output directory.

With ``--hf-config-dir`` its ``config.json`` is the truth (copied as is, after checking that
its shapes fit the checkpoint) and its tokenizer files are copied.  Without it, ``--arch``
names the architecture and the shapes come from the checkpoint; fields that shapes cannot
tell (rope theta, norm epsilon, top-k, ...) take the HF defaults and are listed as guessed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from neon_hpc.arch import ShapeError
from neon_hpc.arch import get as get_architecture
from neon_hpc.reshard.slabs import MappingError
from neon_hpc.reshard.metadata import Checkpoint

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
    """A checkpoint's shapes as an architecture's ``fields_from_shapes`` asks for them (:class:`neon_hpc.arch.Shapes`)."""

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
