"""The balancer as an experiment config sets it up: what the trainer and the CLI call.

    assignment = assignment_for_config(lengths, cfg)        # cfg: neon_hpc.config.ExperimentConfig

DP/PP/CP sizes and the virtual pipeline stages come from ``cfg.train``, the cap and method from ``cfg.balance``,
the cost model from ``balance.cost_a/cost_b``, else ``balance.cost_file`` (a calibration), else
the architecture in ``cfg.model``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from neon_hpc.balance.assignment import StepAssignment
from neon_hpc.balance.cost import CostModel
from neon_hpc.balance.methods import assign_step


def load_cost_file(path: str | Path) -> CostModel:
    """A calibration report (``neon-hpc costfit --out``) or a bare cost-model dict."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: cost file not found; write one with `neon-hpc costfit --out {p}`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object with a 'cost_model' entry")
    return CostModel.from_dict(data.get("cost_model", data), where=str(p))


def cost_model_for_config(cfg) -> CostModel:
    b = cfg.balance
    if b.cost_a > 0 or b.cost_b > 0:
        return CostModel(a=b.cost_a, b=b.cost_b, source="config balance.cost_a/cost_b")
    if b.cost_file:
        return load_cost_file(b.cost_file)
    return CostModel.from_model_config(cfg.model)


def assignment_for_config(lengths: Sequence[int], cfg, cost: CostModel | None = None, **overrides) -> StepAssignment:
    t, b = cfg.train, cfg.balance
    kw = dict(dp=t.data_parallel, pp_microbatches=max(1, b.min_microbatches or t.pipeline_parallel),
              pp_stages=t.pipeline_parallel, cp=t.context_parallel,
              token_cap=b.tokens_per_microbatch, method=b.method, shadow=b.shadow,
              cp_split_threshold=b.split_threshold_tokens, split=b.splits,
              vpp=t.virtual_pipeline_stages)
    kw.update(overrides)
    return assign_step(lengths, cost=cost or cost_model_for_config(cfg), **kw)
