"""Cost-aware balancing: a metadata-only planner that sees sequence lengths and a cost model
and returns which pieces of which sequences each DP rank runs in which micro-batch.

    from neon_hpc.balance import CostModel, plan_step, StepPlan

See README.md beside this file for the flow, the semantics and the metrics.
"""

from neon_hpc.balance.cost import CostModel, attention_flops, flops_breakdown
from neon_hpc.balance.pipeline import pipeline_time
from neon_hpc.balance.plan import Piece, StepPlan, check_plan, microbatch_cost
from neon_hpc.balance.planners import PLANNERS, plan_step

__all__ = ["CostModel", "StepPlan", "Piece", "plan_step", "PLANNERS", "check_plan", "microbatch_cost",
           "pipeline_time", "attention_flops", "flops_breakdown"]
