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

from neon_hpc.hfmap import ARCHES, table
from neon_hpc.reshard.arch import MappingError
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

    The shapes give model fields (:class:`~neon_hpc.models.config.ModelConfig`'s names); their
    HF names, and what the architecture fixes, are the mapping's (:func:`neon_hpc.hfmap` ``hf_fields``),
    the same table the trainer's ``config.json`` is written from."""
    if arch not in ARCHES:
        raise MappingError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHES)}")
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
    if arch == "qwen3_moe":
        fields.update(_derive_gqa(ckpt, proj, fc1))
    else:
        fields.update(_derive_mla(ckpt, proj, fc1))
        guessed += ["routed_scaling_factor", "n_group", "topk_group"]
    cfg = table(arch).hf_fields(fields)
    cfg["tie_word_embeddings"] = "output_layer.weight" not in ckpt.tensors
    return cfg, guessed


def _derive_gqa(ckpt: Checkpoint, proj, fc1) -> dict:
    """Qwen3-MoE fields from GQA shapes: k_layernorm = head_dim, linear_proj cols = heads x head_dim,
    linear_qkv rows = (heads + 2 groups) x head_dim.  The dense width is not in an all-MoE
    checkpoint: it is guessed as the expert width."""
    kn = _layer_key_shape(ckpt, "self_attention.k_layernorm.weight")
    qkv = _layer_key_shape(ckpt, "self_attention.linear_qkv.weight")
    if kn is None or qkv is None or proj is None:
        raise MappingError(f"{ckpt.path}: cannot derive head_dim / head counts (no k_layernorm, linear_qkv "
                           f"or linear_proj); pass --hf-config-dir")
    head_dim = kn[0]
    heads = proj[-1] // head_dim
    return dict(head_dim=head_dim, num_attention_heads=heads, num_query_groups=(qkv[0] // head_dim - heads) // 2,
                num_experts=fc1[0] if fc1 is not None and len(fc1) == 3 else None,
                ffn_hidden_size=fc1[-2] // 2 if fc1 is not None else None)


def _dense_layers(ckpt: Checkpoint) -> list[int]:
    return sorted(int(k.split(".")[2]) for k in ckpt.tensors
                  if k.startswith("decoder.layers.") and k.endswith(".mlp.linear_fc1.weight") and k.split(".")[2].isdigit())


def _derive_mla(ckpt: Checkpoint, proj, fc1) -> dict:
    """DeepSeek-V3 fields from MLA shapes.  With h heads, nope/rope/v head dims n/r/v:
    q_up rows = h(n+r), kv_up rows = h(n+v), linear_proj cols = h*v, kv_down rows = kv_rank + r."""
    kv_norm = _layer_key_shape(ckpt, "self_attention.kv_layernorm.weight") or \
        _layer_key_shape(ckpt, "self_attention.linear_kv_up_proj.layer_norm_weight")
    kv_down = _layer_key_shape(ckpt, "self_attention.linear_kv_down_proj.weight")
    kv_up = _layer_key_shape(ckpt, "self_attention.linear_kv_up_proj.weight")
    q_up = _layer_key_shape(ckpt, "self_attention.linear_q_up_proj.weight") or \
        _layer_key_shape(ckpt, "self_attention.linear_q_proj.weight")
    q_down = _layer_key_shape(ckpt, "self_attention.linear_q_down_proj.weight")
    if None in (kv_norm, kv_down, kv_up, q_up, proj):
        raise MappingError(f"{ckpt.path}: cannot derive the MLA dimensions (missing kv_layernorm, "
                           f"linear_kv_down_proj, linear_kv_up_proj, linear_q_up_proj or linear_proj); "
                           f"pass --hf-config-dir")
    kv_rank = kv_norm[0]
    rope = kv_down[0] - kv_rank
    h_nope = kv_up[0] - proj[-1]
    heads = (q_up[0] - h_nope) // rope
    dense = _dense_layers(ckpt)
    dense_fc1 = ckpt.tensors[f"decoder.layers.{dense[0]}.mlp.linear_fc1.weight"].shape if dense else None
    shared = _layer_key_shape(ckpt, "mlp.shared_experts.linear_fc1.weight")
    moe_i = fc1[-2] // 2 if fc1 is not None else None
    return dict(num_attention_heads=heads, q_lora_rank=q_down[0] if q_down is not None else 0,
                kv_lora_rank=kv_rank, qk_rope_head_dim=rope, qk_nope_head_dim=h_nope // heads,
                v_head_dim=proj[-1] // heads, num_experts=fc1[0] if fc1 is not None else None,
                first_dense_layers=len(dense), ffn_hidden_size=dense_fc1[0] // 2 if dense_fc1 else moe_i,
                num_shared_experts=(shared[0] // 2) // moe_i if shared is not None and moe_i else 0)


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
