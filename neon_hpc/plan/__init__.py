"""Capacity planning: a calibrated discrete-event simulation of the async system (README.md).

    from neon_hpc.plan import simulate, SimParams, from_experiment, compare_with_run

The plan section of the experiment config is ``neon_hpc.config.plan`` (a leaf: importing the
config does not import this package, SimPy or NumPy).
"""
from neon_hpc.plan.params import SimParams, Sourced, from_experiment
from neon_hpc.plan.sim import SimResult, simulate
from neon_hpc.plan.validate import ValidationReport, compare_with_run

__all__ = ["SimParams", "Sourced", "from_experiment", "SimResult", "simulate", "compare_with_run",
           "ValidationReport"]
