"""Cost-aware balancing, metadata only: it sees sequence lengths and a cost model
and returns which pieces of which sequences each DP rank runs in which micro-batch.

    from neon_hpc.balance import CostModel, assign_step, StepAssignment

See README.md beside this file for the flow, the semantics and the metrics.
"""

from neon_hpc.balance.assignment import Piece, StepAssignment, check_assignment, microbatch_cost
from neon_hpc.balance.cost import CostModel, attention_flops, flops_breakdown
from neon_hpc.balance.methods import METHODS, assign_step
from neon_hpc.balance.pipeline import pipeline_time

__all__ = ["CostModel", "StepAssignment", "Piece", "assign_step", "METHODS", "check_assignment", "microbatch_cost",
           "pipeline_time", "attention_flops", "flops_breakdown"]
