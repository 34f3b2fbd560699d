"""What every architecture adapter provides, and the pure parts they share.

Nothing here imports torch, transformers or megatron at module level: the reshard tool (whose
``--dry-run`` imports not even torch) reads the same rule tables as the trainer's exporter.
Tensor helpers work on anything with torch's tensor methods and import nothing.

**The mapping.**  The name rules, the tables every architecture shares and the tensor helpers
are :mod:`neon_hpc.hfmap`'s (imported here, so ``adapters.base.Rule`` and friends keep working):
the reshard tool reads the same objects without importing the models.

**Route rows.**  :class:`RouteRows` is what SGLang sends per token: one row per decoder
layer (``num_hidden_layers``), zeros for layers that never route; the trainer's router replay
takes the MoE rows only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from neon_hpc.hfmap.rules import (COMMON_LAYER_RULES, EXPERT_RULES, IGNORED_SUFFIXES, TOP_RULES,  # noqa: F401
                                  QKVShape, Rule, qkv_join, qkv_part, qkv_rows, tp_join, tp_shard)
from neon_hpc.arch import get as get_architecture
from neon_hpc.config.model import ModelConfig, arch_errors, arch_experiment_errors


class RouteRowsError(ValueError):
    """Routes whose layer axis does not fit the model's route rows (not a per-token glitch)."""


@dataclass(frozen=True)
class RouteRows:
    """Routed-expert rows per token on the wire, and which of them are MoE layers.

    SGLang's capturer has one row per decoder layer (``rows = num_hidden_layers``); layers
    that do not route (dense first layers) are zeros.  ``moe_rows`` are the decoder-layer
    indices of the MoE layers, in order: row ``moe_rows[j]`` feeds the trainer's ``j``-th router.
    """

    rows: int
    moe_rows: tuple[int, ...]

    def to_moe(self, routes: Any, where: str = "routed_experts") -> Any:
        """``[tokens, rows, top_k]`` (numpy) -> ``[tokens, len(moe_rows), top_k]``; raises on a wrong layer axis."""
        shape = tuple(getattr(routes, "shape", ()))
        if len(shape) != 3 or shape[1] != self.rows:
            got = shape[1] if len(shape) == 3 else shape
            hint = (" (one row per MoE layer: an engine that reports MoE layers only; SGLang and the embedded "
                    "engine send one row per decoder layer, zeros for dense layers)"
                    if len(shape) == 3 and shape[1] == len(self.moe_rows) and self.rows != len(self.moe_rows)
                    else "")
            raise RouteRowsError(
                f"{where}: layer axis {got} rows, but the model has {self.rows} route rows (one per "
                f"decoder layer, MoE layers at {list(self.moe_rows)}){hint}; does the engine serve the model in "
                f"model: (num_layers, first_dense_layers)?")
        if len(self.moe_rows) == self.rows:
            return routes
        return routes[:, list(self.moe_rows), :]

    def from_moe(self, moe_routes: Any) -> Any:
        """Inverse of :meth:`to_moe` (numpy): dense rows are zeros, as SGLang sends them."""
        import numpy as np  # deferred: heavy (numpy)
        r = np.asarray(moe_routes)
        out = np.zeros((r.shape[0], self.rows, r.shape[2]), dtype=r.dtype)
        out[:, list(self.moe_rows), :] = r
        return out


# ---------------------------------------------------------------------------------------
# the adapter interface

class Adapter:
    """One architecture: HF config, megatron config and spec, name rules, route rows."""

    name: str = ""
    hf_model_type: str = ""
    hf_architecture: str = ""
    layer_rules: dict[str, Rule] = {}
    expert_rules: dict[str, Rule] = EXPERT_RULES
    top_rules: dict[str, Rule] = TOP_RULES

    # --- pure -----------------------------------------------------------------------------
    def validate(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """``[(field, message)]``: what this architecture refuses in ``cfg`` (the rules are the
        architecture folder's ``config.py``)."""
        return arch_errors(cfg, self.name)

    def moe_layers(self, cfg: ModelConfig) -> list[int]:
        return get_architecture(self.name).moe_layers(cfg)

    def experiment_errors(self, exp: Any) -> list[tuple[str, str]]:
        """``[(key path, message)]``: what this architecture refuses in the rest of an experiment
        config (trainer layout, balancer); ``neon-hpc config check`` reports them
        (the architecture folder's ``config.py``)."""
        return arch_experiment_errors(exp, self.name)

    def route_rows(self, cfg: ModelConfig) -> RouteRows:
        return RouteRows(rows=cfg.num_layers, moe_rows=tuple(self.moe_layers(cfg)))

    def hf_config_dict(self, cfg: ModelConfig) -> dict:
        raise NotImplementedError

    def model_config_from_hf(self, hf_cfg: Any) -> ModelConfig:
        raise NotImplementedError

    def qkv_shape(self, cfg: ModelConfig) -> QKVShape | None:
        return None

    def layer_suffixes(self, cfg: ModelConfig, layer: int) -> list[str]:
        """The megatron (local spec) weight suffixes of decoder layer ``layer``, experts aside."""
        raise NotImplementedError

    def tp_kind(self, key: str) -> str | None:
        """How the megatron weight ``key`` (full name) is split over TP; None = replicated."""
        if key in self.top_rules:
            return self.top_rules[key].tp
        if ".mlp.experts." in key:
            return None                      # expert TP is 1
        parts = key.split(".")
        if key.startswith("decoder.layers.") and len(parts) > 3 and parts[2].isdigit():
            rule = self.layer_rules.get(".".join(parts[3:]))
            return rule.tp if rule else None
        return None

    # --- heavy (lazy imports) ---------------------------------------------------------------
    def hf_model_class(self):
        import transformers  # deferred: heavy (transformers)
        return getattr(transformers, self.hf_architecture)

    def hf_config(self, cfg: ModelConfig):
        from transformers import AutoConfig  # deferred: heavy (transformers)
        d = self.hf_config_dict(cfg)
        d = {k: v for k, v in d.items() if k != "model_type"}
        return AutoConfig.for_model(self.hf_model_type, **d)

    def build_hf_model(self, cfg: ModelConfig, seed: int | None = None):
        """A freshly initialised HF model (float32, eval mode); no download."""
        import torch  # deferred: heavy (torch)
        torch.manual_seed(cfg.seed if seed is None else seed)
        return self.hf_model_class()(self.hf_config(cfg)).eval()

    def hf_routers(self, model) -> list[tuple[int, Any]]:
        """``(decoder layer, router module)`` of an HF model; each router's forward returns
        ``(logits, weights, top-k indices)``."""
        out = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                out.append((i, gate))
        return out

    def transformer_config(self, cfg: ModelConfig, tp: int, ep: int, routing_replay: bool, base: dict,
                           overrides: Mapping[str, Any]):
        raise NotImplementedError

    def layer_spec(self, cfg: ModelConfig, tcfg, vp_stage: int | None = None):
        """The local layer spec; ``vp_stage``: the model chunk (interleaved PP) a block spec is cut for."""
        raise NotImplementedError


def _getter(hf_cfg: Any):
    """``g(name)`` for a config dict or a transformers config object."""
    if isinstance(hf_cfg, dict):
        return hf_cfg.get
    return lambda k, d=None: getattr(hf_cfg, k, d)
