"""Model section of the experiment config: one section per architecture, chosen by ``model.arch``
(a discriminated union, :data:`ModelSection`).

:class:`ModelConfig` (:mod:`neon_hpc.arch.model`) holds what every MoE architecture has; each
architecture's folder adds its own fields and rules (``neon_hpc/arch/<name>/config.py``), so an
architecture's key under another ``arch`` is refused with the fix.  Code that builds one writes
``ModelConfig(arch=..., ...)`` and gets the architecture's class.  The union is assembled here from
the registry (aliases name the same section).
"""
from __future__ import annotations

from neon_hpc import arch
from neon_hpc.arch.model import Errors, ModelConfig, arch_errors, arch_experiment_errors, as_arch, section_of
from neon_hpc.util.constraints import union_of

# model.arch -> its section; an alias (another model_type with the same weights) -> the same section
SECTIONS: dict[str, type] = {a.name: a.config for a in arch.ARCHITECTURES.values()}
ARCH_ALIASES: dict[str, str] = {k: v for k, v in arch.MODEL_TYPES.items() if k != v}
# the ``model:`` section's type: the architecture's section, chosen by its ``arch`` key
ModelSection = union_of(SECTIONS, "arch", arch.DEFAULT, ARCH_ALIASES)
# the section a config without a ``model:`` block gets
DefaultModelConfig: type = SECTIONS[arch.DEFAULT]

__all__ = ["ARCH_ALIASES", "DefaultModelConfig", "Errors", "ModelConfig", "ModelSection", "SECTIONS",
           "arch_errors", "arch_experiment_errors", "as_arch", "section_of"]
