"""neon-hpc: Slurm-native async RL for large MoE models; first task, powder XRD phase analysis."""

__version__ = "0.1.0"
