"""Small helpers every layer may use: bounded text, ports, progress, rank environment, HTTP retry,
process trees, per-role logs and the metrics sinks. Nothing here imports the rest of neon_hpc."""
