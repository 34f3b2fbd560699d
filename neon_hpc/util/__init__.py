"""Small helpers every layer may use: bounded text, ports, progress, rank environment, HTTP retry,
process trees, per-role logs, the metrics sinks, and the config schema's building blocks
(``constraints``: pydantic only, so the architectures' and the environments' sections can use
them without importing the composed config). Nothing here imports the rest of neon_hpc."""
