"""The XRD environment's registration: the entry point ``neon_hpc.envs: xrd`` names ``ENTRY``."""
from neon_hpc.envs.base import EnvEntry
from neon_hpc.envs.xrd.config import XRDConfig

ENTRY = EnvEntry(
    name="xrd", plugin="neon_hpc.envs.xrd.plugin",
    about="powder X-ray diffraction: phases and weight fractions of a pattern, with tools",
    eval_splits=("test_id", "test_ood", "test_temporal"),
    settings=XRDConfig,
    resume="snapshot",
    cli="neon_hpc.envs.xrd.cli", cli_help="the XRD environment: library, tasks, baseline solver, agent evaluation",
)
