"""The policy model in its HF home: the ``transformers`` model of its architecture, built offline.

The HF config fields and model type come from the architecture (:mod:`neon_hpc.arch`, its
folder's ``hfmap.py``); this module builds the transformers objects and does files and
state-dict spellings.

Two state-dict spellings exist and both are handled here and in :mod:`.convert`:

- **on disk** (what ``save_pretrained``, our reshard tool and SGLang use): per-expert
  ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``;
- **in memory** (transformers 5.x): fused ``model.layers.L.mlp.experts.gate_up_proj``
  ``[E, 2*I, H]`` (gate rows first) and ``experts.down_proj`` ``[E, H, I]``.

:func:`save_hf` always writes the on-disk spelling (``model.safetensors`` + ``config.json``),
built in a hidden staging sibling and published by one rename, so an engine polling
``weights/`` never sees a half-written version.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from neon_hpc import arch
from neon_hpc.config.model import ModelConfig
from neon_hpc.protocol.rundir import publish_dir, staging_dir_for

WEIGHTS_FILE = "model.safetensors"
_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_config(cfg: ModelConfig):
    """The transformers config that mirrors ``cfg`` (its architecture's ``hf_config_dict``)."""
    from transformers import AutoConfig  # deferred: heavy (transformers)
    a = arch.get(cfg.arch)
    d = {k: v for k, v in a.hf_config_dict(cfg).items() if k != "model_type"}
    return AutoConfig.for_model(a.hf_model_type, **d)


def model_config_from_hf(hf_cfg: Any) -> ModelConfig:
    """The :class:`ModelConfig` that :func:`hf_config` would have produced ``hf_cfg`` from."""
    d = hf_cfg if isinstance(hf_cfg, dict) else {"model_type": hf_cfg.model_type}
    return arch.for_hf_config(d).model_config_from_hf(hf_cfg)


def hf_model_class(a: arch.Architecture):
    """The transformers model class of architecture ``a``."""
    import transformers  # deferred: heavy (transformers)
    return getattr(transformers, a.hf_architecture)


def build_hf_model(cfg: ModelConfig, seed: int | None = None):
    """A freshly initialised HF model of ``cfg.arch`` (float32, eval mode); no download."""
    torch.manual_seed(cfg.seed if seed is None else seed)
    return hf_model_class(arch.get(cfg.arch))(hf_config(cfg)).eval()


def hf_routers(model) -> list[tuple[int, Any]]:
    """``(decoder layer, router module)`` of an HF model; each router's forward returns
    ``(logits, weights, top-k indices)``."""
    out = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            out.append((i, gate))
    return out


# --------------------------------------------------------------------------------------
# state-dict spellings

def to_disk_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory (fused experts) -> on-disk (per-expert) spelling; other keys unchanged."""
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        m = _FUSED_RE.match(key)
        if not m:
            out[key] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def to_memory_state_dict(sd: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """On-disk (per-expert) -> in-memory (fused) spelling; already-fused keys pass through."""
    per = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, t in sd.items():
        m = per.match(key)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[key] = t
    for prefix, parts in groups.items():
        missing = [f"{prefix}.{e}.{k}_proj.weight" for e in range(num_experts) for k in ("gate", "up", "down")
                   if (e, k) not in parts]
        if missing:
            raise KeyError(f"HF state dict lacks {missing[0]} (and {len(missing) - 1} more expert weights)")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0) for e in range(num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(num_experts)])
    return out


# --------------------------------------------------------------------------------------
# files

def save_hf(model_or_state_dict: Any, cfg: ModelConfig, out_dir: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` + ``config.json`` to ``out_dir`` atomically; returns the path.

    Accepts an HF model or an HF state dict in either spelling (a megatron state dict goes
    through :func:`neon_hpc.models.convert.megatron_to_hf` first).  ``out_dir``
    must not exist yet (published directories are immutable, see :func:`neon_hpc.protocol.rundir.publish_dir`).
    """
    from safetensors.torch import save_file  # deferred: heavy (safetensors)

    sd = model_or_state_dict.state_dict() if hasattr(model_or_state_dict, "state_dict") else model_or_state_dict
    if any(k.startswith(("decoder.", "embedding.")) for k in sd):
        raise ValueError("save_hf got megatron keys (decoder.*, embedding.*); convert them first with "
                         "neon_hpc.models.convert.megatron_to_hf(state_dict, model_cfg)")
    disk = {k: v.detach().to("cpu").contiguous() for k, v in to_disk_state_dict(sd).items()}
    out_dir = Path(out_dir)
    staging = staging_dir_for(out_dir)
    try:
        save_file(disk, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        hf_cfg = hf_config(cfg)
        # the dtype the weights are stored in (bf16 from a bf16 trainer): what SGLang's "auto" serves
        stored = {t.dtype for t in disk.values() if t.is_floating_point()}
        if len(stored) == 1:
            hf_cfg.dtype = str(stored.pop()).removeprefix("torch.")
        (staging / "config.json").write_text(json.dumps(hf_cfg.to_dict(), indent=1, sort_keys=True) + "\n")
        publish_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The on-disk state dict of an HF folder (single file or sharded with an index)."""
    from safetensors.torch import load_file  # deferred: heavy (safetensors)

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / WEIGHTS_FILE).exists():
        files = [WEIGHTS_FILE]
    else:
        raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE} or model.safetensors.index.json; "
                                f"is this an HF weights folder (e.g. RUN/weights/v_N)?")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        sd.update(load_file(str(path / name)))
    return sd


def load_hf(path: str | os.PathLike):
    """Load an HF folder written by :func:`save_hf` or the reshard tool (float32, eval mode)."""
    from transformers import AutoConfig  # deferred: heavy (transformers)

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}/config.json missing: not an HF model folder")
    hf_cfg = AutoConfig.from_pretrained(str(path))
    a = arch.for_hf_config({"model_type": hf_cfg.model_type})
    model = hf_model_class(a)(hf_cfg)
    sd = to_memory_state_dict(read_hf_state_dict(path), a.model_config_from_hf(hf_cfg).num_experts)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise KeyError(f"{path}: weights do not match config.json: missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}")
    return model.to(torch.float32).eval()
