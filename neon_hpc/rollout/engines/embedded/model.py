"""The served model with its routers observed: SGLang's route rows from the model's own routers.

Routes are captured from the model's own routers (a forward hook on each router
:func:`neon_hpc.models.hf.hf_routers` finds) during prefill and decode, never recomputed
afterwards.  They are SGLang's: one row per decoder layer, zeros for layers that do not route (dense
first layers); a shared expert is not a routed choice and has no column.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import torch


def version_from_path(path: str | os.PathLike) -> str:
    """``.../weights/v_7`` -> ``"7"``; anything else -> ``"0"`` (v_0 = initial weights)."""
    m = re.match(r"^v_(\d+)$", Path(path).name)
    return m.group(1) if m else "0"



def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword an HF model's forward takes its KV cache by: transformers >= 5.2x renamed
    ``past_key_values`` to ``cache`` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class LoadedModel:
    """An HF MoE model plus hooks that record every router's top-k indices per forward."""

    def __init__(self, model: torch.nn.Module, path: str, version: str):
        # deferred: heavy (neon_hpc.arch, neon_hpc.models.hf: pydantic)
        from neon_hpc.arch import for_hf_config
        from neon_hpc.models.hf import hf_routers
        self.model, self.path, self.version = model, str(path), str(version)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.top_k = int(cfg.num_experts_per_tok)
        self.eos_ids = _as_list(getattr(cfg, "eos_token_id", None))
        a = for_hf_config({"model_type": cfg.model_type})
        # SGLang's route rows: one row per decoder layer, zeros where a layer does not route
        mcfg = a.model_config_from_hf(cfg)
        self.route_table = a.route_rows(mcfg)
        self.num_experts = int(mcfg.num_experts)
        hooked = hf_routers(model)
        if [layer for layer, _ in hooked] != list(self.route_table.moe_rows):
            raise RuntimeError(f"{path}: routers found at decoder layers {[l for l, _ in hooked]}, but the "
                               f"{a.name} routes at {list(self.route_table.moe_rows)}")
        self.routers = [r for _, r in hooked]
        self.num_moe_layers = len(self.routers)
        # the hook appends to this list, and holds nothing else: a hook bound to self would
        # make model -> hook -> self -> model a cycle, and every replaced model (one per weight
        # update) would then wait for a full gc collection, hours apart (RSS grew ~0.2 MB/update)
        buf: list[torch.Tensor] = []
        self._buf = buf

        def record(module, inputs, output) -> None:
            buf.append(output[2])  # (tokens, top_k) indices of this forward, in layer order

        self._cache_kw = cache_kwarg(model)
        for r in self.routers:
            r.register_forward_hook(record)

    @classmethod
    def load(cls, path: str | os.PathLike, version: str | None = None) -> "LoadedModel":
        from neon_hpc.models.hf import load_hf  # deferred: heavy (neon_hpc.models.hf: pydantic)
        return cls(load_hf(path), str(path), version if version is not None else version_from_path(path))

    @property
    def route_rows(self) -> int:
        """Rows per token in ``routed_experts`` (decoder layers, as SGLang sends them)."""
        return self.route_table.rows

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last position ``[B, V]`` and routes ``[B, S, decoder layers, top_k]``
        (zeros in the rows of layers that do not route)."""
        self._buf.clear()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self._cache_kw: cache})
        b, s = ids.shape
        routed_experts = torch.zeros((b, s, self.route_table.rows, self.top_k), dtype=torch.int64)
        for row, r in zip(self.route_table.moe_rows, self._buf):
            routed_experts[:, :, row] = r.reshape(b, s, self.top_k)
        return out.logits[:, -1, :].float(), routed_experts

    def same_shape_as(self, other: "LoadedModel") -> str | None:
        a, b = self.model.state_dict(), other.model.state_dict()
        if set(a) != set(b):
            return f"parameter names differ ({len(set(a) ^ set(b))} keys)"
        for k in a:
            if a[k].shape != b[k].shape:
                return f"{k}: shape {tuple(b[k].shape)} != served {tuple(a[k].shape)}"
        return None


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]
