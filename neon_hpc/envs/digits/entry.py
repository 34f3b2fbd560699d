"""The digits environment's registration: the entry point ``neon_hpc.envs: digits`` names ``ENTRY``."""
from neon_hpc.envs.base import EnvEntry

ENTRY = EnvEntry(name="digits", plugin="neon_hpc.envs.digits.plugin",
                 about="add two digits, no tools: a task the tiny model learns on CPU", eval_splits=("test_id",),
                 resume="snapshot")
