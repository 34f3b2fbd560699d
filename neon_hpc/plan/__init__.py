"""Capacity planning: a calibrated discrete-event simulation of the async system (README.md).

    from neon_hpc.plan import simulate, SimParams, from_experiment, compare_with_run

Names are imported lazily: ``neon_hpc.config`` imports ``neon_hpc.config.plan`` and must not
pull in SimPy or NumPy with it.
"""
import importlib

_EXPORTS = {
    "SimParams": "neon_hpc.plan.params", "Sourced": "neon_hpc.plan.params",
    "from_experiment": "neon_hpc.plan.params", "SimResult": "neon_hpc.plan.sim",
    "simulate": "neon_hpc.plan.sim", "compare_with_run": "neon_hpc.plan.validate",
    "ValidationReport": "neon_hpc.plan.validate",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'neon_hpc.plan' has no attribute {name!r}")
